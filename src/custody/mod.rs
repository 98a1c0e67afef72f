//! Chain of custody for output folders: evidence.json records the tool
//! version, the exact command line, the blake3 of every input file (for a
//! trace: re-hashed and compared with the digests in trace.json) and the
//! blake3 of every output file. `verify_folder` re-hashes both sides and
//! names every file that changed, went missing or appeared.
//!
//! The digest of a folder's evidence.json ("evidence digest") is what
//! notification packs and look-up answers cite: it pins the outputs and,
//! through them, the inputs. evidence.json is written last and lists every
//! other file in the folder (recursively), so nothing can be added, changed
//! or removed without `verify_folder` noticing.
//!
//! evidence.json is input like any other when it is read back: `load_evidence`
//! refuses a record whose digests are not blake3 hex, whose file paths are
//! absolute, contain `..` or name evidence.json itself, or whose input roots
//! do not lead out of the folder (a root must begin with `..`: an input is
//! never inside the output; a trace in object storage is recorded by its
//! URL, which `verify_folder` lists as not re-read). `verify_folder` follows input folders at most
//! `MAX_NESTING` deep, and refuses a root that names the folder itself, a
//! folder holding it, or one already being verified (a cycle).
//!
//! Output folders: `prepare_out` is the one rule for every command that
//! writes a folder (never inside its input, never over unrelated files;
//! an earlier output of the same kind and input only with `--force`);
//! `prepare_trace_out` the same for commands writing a trace (no
//! `--force`: a trace is only ever written into a new or empty folder), and
//! `create_private_dir` / `write_private` / `make_private` make everything
//! owner-only (folders 0700, files 0600) whatever the umask.
//!
//! Large outputs are recorded with chunk digests (`write_evidence`), so
//! `check_folder_deferred` can check them as they are read
//! (`CheckedFolder::open_file`) instead of up front; `verify_folder`
//! recurses from notify to scope to the trace.

//!
//! - [`evidence`]: what evidence.json holds; [`record`]: writing and
//!   reading it back.
//! - [`inputs`]: hashing a trace or a file as an input.
//! - [`folder`]: checking a folder against its record; [`claims`]: a scope
//!   folder's claims against its trace.
//! - [`out`]: the rule for output folders; [`private`]: owner-only files.
//! - [`keys`]: OpenSSH signing keys and allowed signers; [`seal`]: traces
//!   sealed while they are written, and their check.
//! - [`statement`]: signed findings, an in-toto statement over every file
//!   of an output folder in a DSSE envelope, and its check;
//!   [`reproduce`]: a folder against its re-run.

pub mod claims;
pub mod evidence;
pub mod folder;
pub mod inputs;
pub mod keys;
pub mod out;
pub mod private;
pub mod record;
pub mod reproduce;
pub mod seal;
pub mod statement;

pub use evidence::{
    Chunks, EVIDENCE_JSON, Evidence, FileDigest, FolderProblem, FolderReport, Inputs,
    MAX_EVIDENCE_BYTES, MAX_NESTING,
};
pub use folder::{
    CheckedFolder, check_folder, check_folder_deferred, folder_inputs, is_output_folder,
    verify_folder,
};
pub use inputs::{file_input, hash_file, list_files, trace_inputs};
pub use out::{prepare_out, prepare_trace_out};
pub use private::{
    create_private, create_private_dir, make_private, write_private, write_private_atomic,
};
pub use record::{load_evidence, write_evidence};
