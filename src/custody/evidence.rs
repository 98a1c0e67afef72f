//! What evidence.json records (the tool, the command line, the digest of
//! every input and output file) and what checking a folder against it
//! reports.

use serde::{Deserialize, Serialize};

use crate::trace::chunked::ChunkDigest;

/// File name of the custody record inside an output folder.
pub const EVIDENCE_JSON: &str = "evidence.json";

/// How many input folders deep `verify_folder` follows evidence.json
/// records (a notify folder of a merged scope folder of shards of a trace
/// is 3 deep).
pub const MAX_NESTING: usize = 8;

/// The largest evidence.json read back (a record lists every file of its
/// folder once, with at most `trace::chunked::MAX_CHUNKS` chunk digests
/// per file).
pub const MAX_EVIDENCE_BYTES: u64 = 256 << 20;

/// The input kinds an evidence record may name.
pub(crate) const INPUT_KINDS: [&str; 3] = ["trace", "scope", "config"];

/// One hashed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Relative to the folder's root, `/`-separated.
    pub path: String,
    pub bytes: u64,
    pub blake3: String,
    /// For trace data files: the digest trace.json lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_blake3: Option<String>,
    /// For trace data files: whether the file matched trace.json when the
    /// folder was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matches_manifest: Option<bool>,
    /// For output files of at least `trace::chunked::CHUNKED_FROM` bytes:
    /// the blake3 of every chunk, so that a reader of a few rows checks
    /// only the chunks it reads (`CheckedFolder::open_file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<Chunks>,
}

/// The chunk digests of one file (`trace::chunked`): chunk `i` is bytes
/// `i*chunk_bytes .. (i+1)*chunk_bytes` (the last one shorter).
/// `chunk_bytes` follows from the file's size
/// (`trace::chunked::chunk_bytes_for`); it is recorded so the record
/// reads on its own. `digest` says what the digests are: `blake3-subtree`
/// (what kvtrail writes), each chunk's chaining value in the file's BLAKE3
/// tree, so that they make up the file's `blake3` and a record that
/// contradicts itself is found without reading the file; absent (records
/// of earlier versions), the plain blake3 of each chunk, bound to nothing,
/// so such a file is always checked whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunks {
    pub chunk_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    pub blake3: Vec<String>,
}

impl Chunks {
    /// What the digests are (`check_record` refuses any other `digest`).
    pub fn kind(&self) -> ChunkDigest {
        match self.digest.as_deref() {
            Some(ChunkDigest::SUBTREE) => ChunkDigest::Subtree,
            _ => ChunkDigest::Plain,
        }
    }
}

/// The inputs of a run, under one root directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inputs {
    /// trace | scope | config
    pub kind: String,
    /// Where the input files were, relative to the output folder that
    /// records them (absolute while hashing, and when no relative path
    /// exists).
    pub root: String,
    pub files: Vec<FileDigest>,
    /// Problems found when the inputs were hashed (e.g. a trace file that
    /// does not match trace.json).
    #[serde(default)]
    pub problems: Vec<String>,
}

/// evidence.json.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evidence {
    pub format: String,
    pub version: u32,
    /// scope | notify
    pub kind: String,
    pub tool: String,
    pub tool_version: String,
    /// The command line exactly as given (argv).
    pub command: Vec<String>,
    pub inputs: Vec<Inputs>,
    pub outputs: Vec<FileDigest>,
}

/// One difference found by `verify_folder`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct FolderProblem {
    /// output | input
    pub side: String,
    /// The file, relative to its root (inputs: prefixed with the root).
    pub path: String,
    /// modified | missing | extra | unavailable | contradicts | unverifiable
    pub kind: String,
    pub detail: String,
}

/// Result of checking an output folder against its evidence.json.
#[derive(Debug, Clone, Serialize)]
pub struct FolderReport {
    pub ok: bool,
    /// scope | notify
    pub kind: String,
    pub evidence_blake3: String,
    pub outputs_checked: usize,
    pub inputs_checked: usize,
    /// Input roots that are not on this machine (not checked; not a failure).
    pub inputs_unavailable: Vec<String>,
    /// Problems recorded when the folder was written (e.g. trace files that
    /// did not match trace.json then).
    pub recorded_input_problems: Vec<String>,
    pub problems: Vec<FolderProblem>,
    /// Nested checks of input folders that carry their own evidence.json.
    pub nested: Vec<FolderReport>,
}
