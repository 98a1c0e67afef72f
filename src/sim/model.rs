//! The reference model: a tiny deterministic, integer-only "LLM" whose
//! output depends on exactly the KV a request attended over. The simulator
//! uses it to give every response a real output hash; the replay reuses it
//! to recompute a response with its foreign slots replaced by its own KV
//! (counterfactual), and a CUDA kernel can match it bit for bit.
//!
//! # Exact arithmetic (all u64, wrapping; `^` xor, `>>` logical shift)
//!
//! ```text
//! mix64(x):  z = x + 0x9E3779B97F4A7C15
//!            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//!            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//!            return z ^ (z >> 31)                       (splitmix64)
//! seed(R)           = u64 little-endian of prompt_hash(R)[0..8]
//! kv(seed, pos)     = mix64(seed ^ mix64(pos))          KV a request with that
//!                                                       seed writes at position pos
//! value of a slot   = kv(seed(owner), owner_pos)        owner = the request whose KV
//!                                                       the slot holds (content owner,
//!                                                       through copies), owner_pos = the
//!                                                       position it wrote it at;
//!                     0                                 blank (never written, scrubbed)
//! term(v, p)        = mix64(v + p * 0xD6E8FEB86659FD93)
//! output of a request with decode prompt length L and T output tokens,
//! given V[0..L+T) = the values of its decode slots for positions 0..L+T
//! as its LAST decode read saw them:
//!     g = sum_{p < L} term(V[p], p)
//!     for j in 0..T:  g = g + term(V[L+j], L+j)
//!                     token_j = mix64(g ^ j) mod 2^16
//! output_hash = blake3 of token_j as u32 little-endian (schema::hash_tokens)
//! ```
//!
//! Decode step j writes the KV of position L+j and attends over positions
//! 0..=L+j; the sum is order-independent, so a GPU may reduce it in any
//! order. Prompt token ids (for prompt_hash) are
//! `prompt_token(seed, p) = mix64(seed ^ mix64(p) ^ 0x5851F42D4C957F2D) mod 2^16`,
//! with the prefix group's seed for shared-prefix positions (a prompt above
//! `workload::HASHED_PROMPT_TOKENS` is hashed by its description instead:
//! see `Arrival::prompt_hash`).

/// Vocabulary size of the reference model (token ids are 16-bit).
pub const VOCAB: u32 = 1 << 16;

/// splitmix64 finalizer.
#[inline]
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The model seed of a request: the first 8 bytes of its prompt hash.
pub fn seed(prompt_hash: &[u8; 32]) -> u64 {
    u64::from_le_bytes(prompt_hash[..8].try_into().expect("8 bytes"))
}

/// KV value written by a request with `seed` at position `pos`.
#[inline]
pub fn kv(seed: u64, pos: u32) -> u64 {
    mix64(seed ^ mix64(pos as u64))
}

/// Value of a slot: its content owner's KV, or 0 when blank.
#[inline]
pub fn slot_value(owner: Option<(u64, u32)>) -> u64 {
    match owner {
        Some((seed, pos)) => kv(seed, pos),
        None => 0,
    }
}

#[inline]
fn term(v: u64, p: u32) -> u64 {
    mix64(v.wrapping_add((p as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)))
}

/// Sum of `term` over prompt positions (`values[p]` for p in 0..len).
pub fn prompt_sum(values: &[u64]) -> u64 {
    values
        .iter()
        .enumerate()
        .fold(0u64, |g, (p, &v)| g.wrapping_add(term(v, p as u32)))
}

/// Output tokens given the prompt sum and the values of the generated
/// positions L..L+T as read.
pub fn generate(prompt_sum: u64, prompt_len: u32, gen_values: &[u64]) -> Vec<u32> {
    let mut g = prompt_sum;
    gen_values
        .iter()
        .enumerate()
        .map(|(j, &v)| {
            g = g.wrapping_add(term(v, prompt_len + j as u32));
            (mix64(g ^ j as u64) % VOCAB as u64) as u32
        })
        .collect()
}

/// Output tokens of a request: `context[..prompt_len]` are the prompt
/// positions, the rest one per output token (see the module docs).
pub fn output_tokens(context: &[u64], prompt_len: usize) -> Vec<u32> {
    let s = prompt_sum(&context[..prompt_len]);
    generate(s, prompt_len as u32, &context[prompt_len..])
}

/// Prompt token id at position `p` for a content seed.
#[inline]
pub fn prompt_token(seed: u64, p: u32) -> u32 {
    (mix64(seed ^ mix64(p as u64) ^ 0x5851_F42D_4C95_7F2D) % VOCAB as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix64_matches_splitmix64_reference_values() {
        // splitmix64 with state 0: first output is mix64(0).
        assert_eq!(mix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(mix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn foreign_kv_changes_the_output_and_own_kv_does_not() {
        let own = 7u64;
        let ctx: Vec<u64> = (0..40).map(|p| kv(own, p)).collect();
        let a = output_tokens(&ctx, 30);
        assert_eq!(a.len(), 10);
        assert_eq!(a, output_tokens(&ctx, 30));
        let mut foreign = ctx.clone();
        foreign[5] = kv(99, 5);
        assert_ne!(a, output_tokens(&foreign, 30));
        let mut blank = ctx;
        blank[5] = slot_value(None);
        assert_ne!(a, output_tokens(&blank, 30));
    }
}
