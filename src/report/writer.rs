//! A scope folder written whole or not at all. `write_atomically` is the
//! one way a folder is put in place: it is filled under a temporary
//! sibling name (`.NAME.XXXXXX`, owner-only, on the same file system) and
//! renamed over its final name (absent, or an empty folder) only once
//! every file is written; on any failure the sibling is removed and
//! nothing is left. `write_scope_folder` (`scope --out`) and
//! `write_merged_folder` (`merge --out`, `fleet spark`) write a scope
//! folder through it: the findings files (`report::write_out`), a shard's
//! shard.json, then the rest (`report::bundle`) and evidence.json, and
//! with `--signing-key` the signed statement over all of them last
//! (`Signing`, `custody::statement`).
//! `fleet spark` puts its shard folders in place and `demo` its simulated
//! trace the same way. The folder is read back by `report::folder`.

use std::path::{Path, PathBuf};

use crate::custody::keys::SigningKey;
use crate::custody::statement::{self, Predicate};
use crate::error::{Error, Location, Result};
use crate::scope::ScopeReport;
use crate::scope::shard::{ShardFolder, ShardInfo};
use crate::trace::read::Trace;

/// Fills a folder and puts it at `dest` all at once: `write` gets a new,
/// empty, owner-only sibling of `dest` (same parent, so the same file
/// system), and only when it returns `Ok` does the sibling replace `dest`
/// (which must be absent or an empty folder). On any failure the sibling
/// is removed and `dest` is as it was. A link at `dest`, or `dest` naming
/// an existing folder through `.` or `..`, is resolved first: the folder it
/// names is replaced. The parent is created when missing.
pub fn write_atomically<T, E: From<Error>>(
    dest: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let target = if dest.exists() {
        std::fs::canonicalize(dest).map_err(|e| Error::io(dest, e))?
    } else if dest.is_symlink() {
        return Err(Error::invalid(
            Location::file(dest),
            "a link to nothing",
            "pass a new folder, or a link to an empty folder",
        )
        .into());
    } else {
        dest.to_path_buf()
    };
    let name = target
        .file_name()
        .filter(|n| *n != "..")
        .ok_or_else(|| {
            Error::invalid(
                Location::file(dest),
                "not a folder name",
                "pass the folder's path, e.g. out/incident",
            )
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(&parent).map_err(|e| Error::io(&parent, e))?;
    }
    // tempfile creates the folder owner-only (0700) and removes it when
    // dropped: on every early return below.
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .tempdir_in(&parent)
        .map_err(|e| Error::io(&parent, e))?;
    let value = write(tmp.path())?;
    if target.is_dir() {
        std::fs::remove_dir(&target).map_err(|e| Error::io(&target, e))?;
    }
    std::fs::rename(tmp.path(), &target).map_err(|e| Error::io(&target, e))?;
    // Renamed: nothing is left to remove.
    let _ = tmp.keep();
    Ok(value)
}

/// A scope folder as written: its files under their final path (`dest`
/// as given, joined with each name, in the order written) and the evidence
/// digest (blake3 of evidence.json).
#[derive(Debug, Clone)]
pub struct Written {
    pub files: Vec<PathBuf>,
    pub digest: String,
}

/// `write` into a temporary folder, its files' paths moved under `dest`.
fn write_scope_files(
    dest: &Path,
    write: impl FnOnce(&Path) -> Result<(Vec<PathBuf>, String)>,
) -> Result<Written> {
    write_atomically(dest, |tmp| {
        let (files, digest) = write(tmp)?;
        let files = files
            .iter()
            .map(|f| dest.join(f.strip_prefix(tmp).unwrap_or(f)))
            .collect();
        Ok(Written { files, digest })
    })
}

/// Writes the scope folder of a run at `dest` (`write_atomically`): the
/// findings files, a shard's shard.json (before evidence.json, so the
/// evidence lists it), report.html, the request list and its look-up
/// file, the exports and evidence.json. `command` is the command line as
/// given (report.html and evidence.json show it).
pub fn write_scope_folder(
    dest: &Path,
    trace: &Trace,
    report: &ScopeReport,
    shard: Option<&ShardInfo>,
    command: &[String],
) -> Result<Written> {
    write_scope_folder_signed(dest, trace, report, shard, command, None)
}

/// The statement a folder gets last, inside its atomic write
/// (`--signing-key`): the key and the predicate so far (command, options,
/// backend); the writer adds the inputs it reads and the verdict.
pub struct Signing<'a> {
    pub key: &'a SigningKey,
    pub predicate: Predicate,
}

impl Signing<'_> {
    /// Writes the folder's statement over every file now in `dir`, with
    /// `inputs` and the report's verdict; returns its path.
    fn sign(
        self,
        dir: &Path,
        inputs: Vec<statement::StatementInput>,
        report: &ScopeReport,
    ) -> Result<PathBuf> {
        let mut p = self.predicate;
        p.inputs = inputs;
        p.verdict = one_line(&report.verdict);
        statement::sign_folder(dir, self.key, p)?;
        Ok(dir.join(statement::STATEMENT_FILE))
    }
}

/// A verdict as one line.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `write_scope_folder`, and with `sign` the folder's statement
/// (`custody::statement`), written last: the folder never appears without
/// it.
pub fn write_scope_folder_signed(
    dest: &Path,
    trace: &Trace,
    report: &ScopeReport,
    shard: Option<&ShardInfo>,
    command: &[String],
    sign: Option<Signing<'_>>,
) -> Result<Written> {
    write_scope_files(dest, |dir| {
        let mut files = super::write_out(report, dir)?;
        if let Some(s) = shard {
            files.push(s.write(dir)?);
        }
        let (extra, digest) = super::bundle::write_scope_extras(trace, report, dir, command)?;
        files.extend(extra);
        if let Some(s) = sign {
            files.push(s.sign(dir, vec![statement::trace_input(trace)?], report)?);
        }
        Ok((files, digest))
    })
}

/// Writes the scope folder of merged shards at `dest`
/// (`write_atomically`), evidence.json citing the shard folders. `last`
/// is asked once every file is written, before the folder is put in
/// place: an error there (an interruption) leaves nothing.
pub fn write_merged_folder(
    dest: &Path,
    shards: &[ShardFolder],
    report: &ScopeReport,
    command: &[String],
    last: impl FnOnce() -> Result<()>,
) -> Result<Written> {
    write_merged_folder_signed(dest, shards, report, command, None, last)
}

/// `write_merged_folder`, and with `sign` the folder's statement (its
/// inputs: each shard folder with the digests of its evidence.json and
/// statement), written last.
pub fn write_merged_folder_signed(
    dest: &Path,
    shards: &[ShardFolder],
    report: &ScopeReport,
    command: &[String],
    sign: Option<Signing<'_>>,
    last: impl FnOnce() -> Result<()>,
) -> Result<Written> {
    write_scope_files(dest, |dir| {
        let mut files = super::write_out(report, dir)?;
        let (extra, digest) = super::bundle::write_merge_extras(shards, report, dir, command)?;
        files.extend(extra);
        if let Some(s) = sign {
            let inputs = shards
                .iter()
                .map(|sh| statement::folder_input(&sh.dir, "scope"))
                .collect::<Result<Vec<_>>>()?;
            files.push(s.sign(dir, inputs, report)?);
        }
        last()?;
        Ok((files, digest))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::custody::{self, EVIDENCE_JSON};
    use crate::lineage::BackendChoice;
    use crate::progress::NoReporter;
    use crate::report::folder::{SUMMARY_JSON, ScopeFolder};
    use crate::scope::run::ScopeRun;

    /// A scope folder of the golden v1 trace, written as `scope --out`
    /// writes it (`pools`: as `scope --pools`).
    fn write_folder(dir: &Path, pools: Option<Vec<u16>>) -> Written {
        let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
        let s = ScopeRun::open(&trace, BackendChoice::Cpu)
            .unwrap()
            .run(pools, &NoReporter)
            .unwrap();
        let command = ["kvtrail".to_string(), "scope".to_string()];
        write_scope_folder(dir, &s.trace, &s.report, s.shard.as_ref(), &command).unwrap()
    }

    /// The names in a folder, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_scope_folder_is_written_under_its_final_name_with_nothing_beside_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("scope");
        let w = write_folder(&dir, Some(vec![0]));
        assert_eq!(names(tmp.path()), ["scope"]);
        assert!(w.files.iter().all(|f| f.starts_with(&dir)), "{:?}", w.files);
        assert!(w.files.iter().all(|f| f.is_file()), "{:?}", w.files);
        assert_eq!(w.files.last().unwrap(), &dir.join(EVIDENCE_JSON));
        assert!(w.files.contains(&dir.join(crate::scope::shard::SHARD_FILE)));
        let ev = std::fs::read(dir.join(EVIDENCE_JSON)).unwrap();
        assert_eq!(w.digest, blake3::hash(&ev).to_hex().to_string());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        // The trace is cited relative to the folder where it now lies.
        let (ev, _) = custody::load_evidence(&dir).unwrap();
        assert_eq!(
            std::fs::canonicalize(dir.join(&ev.inputs[0].root)).unwrap(),
            std::fs::canonicalize(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1")
            )
            .unwrap()
        );
    }

    #[test]
    fn a_failure_midway_leaves_no_partial_folder_and_no_temporary_sibling() {
        let tmp = tempfile::tempdir().unwrap();
        // A new folder, an empty one, and a link to an empty one.
        std::fs::create_dir(tmp.path().join("empty")).unwrap();
        std::fs::create_dir(tmp.path().join("real")).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink("real", tmp.path().join("link")).unwrap();
        let before = names(tmp.path());
        for dest in ["new", "empty", "link", "deeper/new"] {
            let dest = tmp.path().join(dest);
            if !cfg!(unix) && dest.ends_with("link") {
                continue;
            }
            let mut seen = None;
            let e = write_atomically(&dest, |dir| {
                std::fs::write(dir.join("a.csv"), "half").unwrap();
                std::fs::create_dir(dir.join("sub")).unwrap();
                seen = Some(dir.to_path_buf());
                Err::<(), _>(Error::Other("the disk filled".into()))
            })
            .unwrap_err();
            assert_eq!(e.to_string(), "the disk filled");
            let seen = seen.unwrap();
            assert!(!seen.exists(), "{} left", seen.display());
            let mut want = before.clone();
            if dest.ends_with("deeper/new") {
                // The missing parent was made; nothing is in it.
                want.push("deeper".into());
                want.sort();
                assert!(names(&tmp.path().join("deeper")).is_empty());
            }
            assert_eq!(names(tmp.path()), want, "{}", dest.display());
            for d in ["empty", "real"] {
                assert!(names(&tmp.path().join(d)).is_empty(), "{d}");
            }
        }
        // A merged folder whose last check fails once every file is written.
        let before = names(tmp.path());
        let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
        let full = ScopeRun::open(&trace, BackendChoice::Cpu)
            .unwrap()
            .run(None, &NoReporter)
            .unwrap();
        let pools: Vec<u16> = full.report.deployment.pools.iter().map(|p| p.id).collect();
        let s = ScopeRun::open(&trace, BackendChoice::Cpu)
            .unwrap()
            .run(Some(pools), &NoReporter)
            .unwrap();
        let shards_tmp = tempfile::tempdir().unwrap();
        let shard = shards_tmp.path().join("shard-0000");
        let command = ["kvtrail".to_string()];
        write_scope_folder(&shard, &s.trace, &s.report, s.shard.as_ref(), &command).unwrap();
        let loaded = crate::scope::shard::load_shards(&[shard]).unwrap();
        let parts: Vec<_> = loaded
            .iter()
            .map(|s| (s.report.clone(), s.info.clone()))
            .collect();
        let merged = crate::scope::merge::merge(&parts).unwrap();
        let dest = tmp.path().join("merged");
        let mut asked = false;
        let e = write_merged_folder(&dest, &loaded, &merged, &command, || {
            asked = true;
            Err(Error::Other("interrupted".into()))
        })
        .unwrap_err();
        assert!(asked);
        assert_eq!(e.to_string(), "interrupted");
        assert_eq!(names(tmp.path()), before);
    }

    #[test]
    fn a_folder_replaces_an_empty_one_or_a_link_target_and_refuses_a_full_one() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("empty")).unwrap();
        let put = |name: &str| {
            write_atomically(&tmp.path().join(name), |d| {
                std::fs::write(d.join("x"), name).map_err(|e| Error::io(d, e))
            })
        };
        put("empty").unwrap();
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("empty/x")).unwrap(),
            "empty"
        );
        #[cfg(unix)]
        {
            std::fs::create_dir(tmp.path().join("real")).unwrap();
            std::os::unix::fs::symlink("real", tmp.path().join("link")).unwrap();
            put("link").unwrap();
            assert!(tmp.path().join("link").is_symlink());
            assert_eq!(
                std::fs::read_to_string(tmp.path().join("real/x")).unwrap(),
                "link"
            );
            std::os::unix::fs::symlink("nowhere", tmp.path().join("dangling")).unwrap();
            let e = put("dangling").unwrap_err().to_string();
            assert!(e.contains("a link to nothing"), "{e}");
        }
        // Not empty: refused, the sibling removed, the folder untouched.
        let before = names(tmp.path());
        assert!(put("empty").is_err());
        assert_eq!(names(tmp.path()), before);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("empty/x")).unwrap(),
            "empty"
        );
    }

    #[test]
    fn an_unedited_folder_opens_intact_with_its_digests_and_requests() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("scope");
        write_folder(&dir, None);
        let f = ScopeFolder::open(&dir).unwrap();
        assert!(f.intact(), "{:?}", f.check());
        assert!(f.evidence_problems().is_empty());
        let digest = |name: &str| {
            let bytes = std::fs::read(dir.join(name)).unwrap();
            blake3::hash(&bytes).to_hex().to_string()
        };
        assert_eq!(f.evidence_blake3(), digest(EVIDENCE_JSON));
        assert_eq!(f.summary_blake3(), digest(SUMMARY_JSON));
        assert_eq!(f.coverage(), &f.summary().coverage);
        let mut n = 0u64;
        f.requests(|_| {
            n += 1;
            true
        })
        .unwrap();
        assert!(n > 0);
        assert_eq!(n, f.summary().counts.requests);
        f.refuse_shard("lookup").unwrap();
        let inp = f.as_input().unwrap();
        assert_eq!(inp.kind, "scope");
        let listed: Vec<&str> = inp.files.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(listed, custody::list_files(&dir).unwrap());
        let ev = inp.files.iter().find(|x| x.path == EVIDENCE_JSON).unwrap();
        assert_eq!(ev.blake3, digest(EVIDENCE_JSON));
        assert_eq!(
            ev.bytes,
            std::fs::metadata(dir.join(EVIDENCE_JSON)).unwrap().len()
        );
    }

    /// How a tampered folder is met.
    enum Expect {
        /// `open` refuses it with this message.
        Refused(&'static str),
        /// It opens, is not intact, names this problem, and is refused as
        /// the input of another run.
        NotIntact(&'static str),
    }

    fn check(name: &str, edit: impl FnOnce(&Path), expect: Expect) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("scope");
        write_folder(&dir, None);
        edit(&dir);
        match (ScopeFolder::open(&dir), expect) {
            (Err(e), Expect::Refused(msg)) => {
                assert!(e.to_string().contains(msg), "{name}: {e}")
            }
            (Ok(f), Expect::NotIntact(problem)) => {
                assert!(!f.intact(), "{name}");
                let problems = f.evidence_problems().join("\n");
                assert!(problems.contains(problem), "{name}: {problems}");
                let e = f.as_input().unwrap_err().to_string();
                assert!(
                    e.contains("does not match its evidence.json"),
                    "{name}: {e}"
                );
            }
            (Ok(f), _) => panic!("{name}: opened, intact {}", f.intact()),
            (Err(e), _) => panic!("{name}: refused: {e}"),
        }
    }

    fn append(p: PathBuf) {
        let mut b = std::fs::read(&p).unwrap();
        b.push(b'\n');
        std::fs::write(&p, b).unwrap();
    }

    #[test]
    fn a_tampered_folder_is_refused_or_opened_as_not_intact() {
        check(
            "requests.csv edited",
            |d| append(d.join("requests.csv")),
            Expect::NotIntact("modified requests.csv"),
        );
        check(
            "summary.json edited (still a summary)",
            |d| append(d.join(SUMMARY_JSON)),
            Expect::NotIntact("modified summary.json"),
        );
        check(
            "report.html removed",
            |d| std::fs::remove_file(d.join("report.html")).unwrap(),
            Expect::NotIntact("missing report.html"),
        );
        check(
            "a file added",
            |d| std::fs::write(d.join("extra.txt"), "x").unwrap(),
            Expect::NotIntact("extra extra.txt"),
        );
        check(
            "evidence.json removed",
            |d| std::fs::remove_file(d.join(EVIDENCE_JSON)).unwrap(),
            Expect::Refused("not a scope folder with a chain of custody (no evidence.json)"),
        );
        check(
            "summary.json removed",
            |d| std::fs::remove_file(d.join(SUMMARY_JSON)).unwrap(),
            Expect::Refused("not a scope folder (no evidence.json or summary.json)"),
        );
        check(
            "evidence.json not a record",
            |d| std::fs::write(d.join(EVIDENCE_JSON), "{}").unwrap(),
            Expect::Refused("not a kvtrail evidence record"),
        );
        check(
            "evidence.json lists a path outside the folder",
            |d| {
                let p = d.join(EVIDENCE_JSON);
                let t = std::fs::read_to_string(&p).unwrap();
                let t = t.replacen("\"path\": \"report.html\"", "\"path\": \"../x\"", 1);
                std::fs::write(&p, t).unwrap();
            },
            Expect::Refused("is not a path inside the folder"),
        );
        check(
            "summary.json not a summary",
            |d| std::fs::write(d.join(SUMMARY_JSON), "[]").unwrap(),
            Expect::Refused("not a kvtrail scope summary"),
        );
        check(
            "summary.json of another format",
            |d| {
                let p = d.join(SUMMARY_JSON);
                let t = std::fs::read_to_string(&p).unwrap();
                std::fs::write(&p, t.replacen("\"kvtrail-scope\"", "\"other\"", 1)).unwrap();
            },
            Expect::Refused("unsupported scope format \"other\" version 1"),
        );
    }

    #[test]
    fn a_shard_folder_opens_but_is_refused_where_every_pool_is_needed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("shard");
        write_folder(&dir, Some(vec![0]));
        let f = ScopeFolder::open(&dir).unwrap();
        assert!(f.intact());
        assert!(!f.coverage().complete);
        let e = f.refuse_shard("notify").unwrap_err().to_string();
        assert!(
            e.contains("this is a shard folder") && e.contains("notify"),
            "{e}"
        );
    }
}
