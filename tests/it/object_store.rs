//! Traces in object storage: `verify`, `inspect`, `scope` and `sql` on a
//! trace in S3 (moto's server on 127.0.0.1, .ci/setup.d/56-moto.sh) and on
//! a static HTTP server with Range (tests/objstore/server.py), against a
//! local copy of the same trace: the same results byte for byte (the
//! trace's location aside), the same exit codes for a wrong digest and a
//! missing object, and exit 2 with a message naming the URL for a refused
//! credential, an unreachable endpoint, a bucket without the trace and an
//! object replaced between listing and reading (no `--out` folder left).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::cli::{Ran, kvtrail};
use crate::support::files::copy_dir;
use crate::support::objstore::{Server, on_s3 as s3_env, start};

const MINI: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/incident-mini");
const BUCKET: &str = "traces";

/// Local copies of incident-mini, one per case.
struct Cases {
    _tmp: tempfile::TempDir,
    /// As captured.
    mini: PathBuf,
    /// trace.json lists a wrong digest for kv/pool=0.
    bad_digest: PathBuf,
    /// kv/pool=1's file is gone.
    missing: PathBuf,
    /// kv/pool=1's file with one byte flipped (as tests/objstore/server.py
    /// flips it), trace.json unchanged.
    flipped: PathBuf,
    /// kv/pool=1's file named `part%3A00000.parquet` (a name stores and
    /// servers percent-encode), trace.json listing it so.
    pct: PathBuf,
}

fn cases() -> &'static Cases {
    static C: OnceLock<Cases> = OnceLock::new();
    C.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let mini = tmp.path().join("mini");
        copy_dir(Path::new(MINI), &mini);
        let bad_digest = tmp.path().join("bad_digest");
        copy_dir(&mini, &bad_digest);
        let tj = bad_digest.join("trace.json");
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&tj).unwrap()).unwrap();
        for f in m["files"].as_array_mut().unwrap() {
            if f["path"] == "kv/pool=0/part-00000.parquet" {
                f["blake3"] = serde_json::Value::String("0".repeat(64));
            }
        }
        std::fs::write(&tj, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let missing = tmp.path().join("missing");
        copy_dir(&mini, &missing);
        std::fs::remove_file(missing.join("kv/pool=1/part-00000.parquet")).unwrap();
        let flipped = tmp.path().join("flipped");
        copy_dir(&mini, &flipped);
        let f = flipped.join("kv/pool=1/part-00000.parquet");
        let mut data = std::fs::read(&f).unwrap();
        let i = data.len() / 2;
        data[i] ^= 0xFF;
        std::fs::write(&f, data).unwrap();
        let pct = tmp.path().join("pct");
        copy_dir(&mini, &pct);
        std::fs::rename(
            pct.join("kv/pool=1/part-00000.parquet"),
            pct.join("kv/pool=1/part%3A00000.parquet"),
        )
        .unwrap();
        let tj = pct.join("trace.json");
        let text = std::fs::read_to_string(&tj).unwrap();
        assert!(text.contains("kv/pool=1/part-00000.parquet"));
        std::fs::write(
            &tj,
            text.replace(
                "kv/pool=1/part-00000.parquet",
                "kv/pool=1/part%3A00000.parquet",
            ),
        )
        .unwrap();
        Cases {
            _tmp: tmp,
            mini,
            bad_digest,
            missing,
            flipped,
            pct,
        }
    })
}

/// One moto server for the module: bucket `traces` with each case under
/// its own prefix (and `changing/`, replaced after it is listed), and an
/// empty bucket.
fn s3() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let c = cases();
        let spec = c._tmp.path().join("spec.json");
        let up = |dir: &Path, prefix: &str| serde_json::json!({"dir": dir, "prefix": prefix});
        std::fs::write(
            &spec,
            serde_json::json!({
                "bucket": BUCKET,
                "empty_bucket": "empty",
                "uploads": [
                    up(&c.mini, "mini"),
                    up(&c.bad_digest, "bad_digest"),
                    up(&c.missing, "missing"),
                    up(&c.mini, "changing"),
                    up(&c.pct, "pct"),
                ],
                "changing": "changing/kv/pool=0/part-00000.parquet",
            })
            .to_string(),
        )
        .unwrap();
        start(&["s3", spec.to_str().unwrap()])
    })
}

/// A moto server that checks credentials, holding only `mini/trace.json`
/// (its signature check misreads object keys with `=`, the Hive folders).
fn s3_auth() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let c = cases();
        let spec = c._tmp.path().join("spec-auth.json");
        std::fs::write(
            &spec,
            serde_json::json!({
                "bucket": BUCKET,
                "auth": true,
                "uploads": [{"dir": c.mini, "prefix": "mini", "only": ["trace.json"]}],
            })
            .to_string(),
        )
        .unwrap();
        start(&["s3", spec.to_str().unwrap()])
    })
}

/// `kvtrail ARGS` with the S3 server's endpoint and credentials (never the
/// host's: the instance-metadata endpoint points at a closed local port).
fn on_s3(args: &[&str]) -> crate::support::cli::Kvtrail {
    on(s3(), args)
}

fn on(s: &Server, args: &[&str]) -> crate::support::cli::Kvtrail {
    crate::support::objstore::on_s3(s, kvtrail(args))
}

fn url(prefix: &str) -> String {
    format!("s3://{BUCKET}/{prefix}")
}

/// Output of a remote run with the trace's URL written as the local path.
fn as_local(text: &str, url: &str, local: &Path) -> String {
    text.replace(url, local.to_str().unwrap())
}

fn same(remote: &Ran, local: &Ran, url: &str, dir: &Path, what: &str) {
    assert_eq!(
        remote.code, local.code,
        "{what}: exit codes differ\nremote stderr: {}\nlocal stderr: {}",
        remote.stderr, local.stderr
    );
    assert_eq!(
        as_local(&remote.stdout, url, dir),
        local.stdout,
        "{what}: stdout differs from the local copy's"
    );
}

fn compare(prefix: &str, dir: &Path) {
    let u = url(prefix);
    for (args, what) in [
        (vec!["verify", "--json"], "verify"),
        (vec!["inspect", "--json"], "inspect"),
        (vec!["scope", "--json"], "scope"),
    ] {
        let mut r: Vec<&str> = args.clone();
        r.insert(1, &u);
        let mut l: Vec<&str> = args.clone();
        l.insert(1, dir.to_str().unwrap());
        let remote = on_s3(&r).run();
        let local = kvtrail(&l).run();
        assert!(!remote.timed_out, "{what} timed out");
        same(&remote, &local, &u, dir, &format!("{what} {prefix}"));
    }
}

#[test]
fn s3_verify_inspect_scope_equal_a_local_copy() {
    let c = cases();
    compare("mini", &c.mini);
    // scope --out: every file of the folder, byte for byte.
    let tmp = tempfile::tempdir().unwrap();
    let (ro, lo) = (tmp.path().join("remote"), tmp.path().join("local"));
    let u = url("mini");
    on_s3(&["scope", &u, "--out", ro.to_str().unwrap()])
        .expect(&[0])
        .run();
    kvtrail([
        "scope",
        c.mini.to_str().unwrap(),
        "--out",
        lo.to_str().unwrap(),
    ])
    .expect(&[0])
    .run();
    let mut names: Vec<_> = std::fs::read_dir(&lo)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(names.len() >= 8, "{names:?}");
    for n in &names {
        let l = std::fs::read(lo.join(n)).unwrap();
        let r = std::fs::read(ro.join(n)).unwrap_or_else(|e| panic!("{n:?}: {e}"));
        if l == r {
            continue;
        }
        let (ls, rs) = (String::from_utf8_lossy(&l), String::from_utf8_lossy(&r));
        if n != "evidence.json" {
            // report.html shows the command line: the same once the URL
            // reads as the local path and the output folders swap.
            // (report.html writes `/` as `&#x2f;`: compared unescaped.)
            let (ls, rs) = (ls.replace("&#x2f;", "/"), rs.replace("&#x2f;", "/"));
            let rs = as_local(&rs, &u, &c.mini).replace(ro.to_str().unwrap(), lo.to_str().unwrap());
            assert_eq!(rs, ls, "{n:?} differs from the local copy's");
            continue;
        }
        // evidence.json names the command line and the input's root (the
        // URL; a local input is named relative to the folder), and the
        // digest of report.html (compared above): all else, the digests of
        // every input file included, is equal.
        let json = |b: &[u8]| {
            let mut v: serde_json::Value = serde_json::from_slice(b).unwrap();
            v["command"] = serde_json::Value::Null;
            for i in v["inputs"].as_array_mut().unwrap() {
                i["root"] = serde_json::Value::Null;
            }
            for o in v["outputs"].as_array_mut().unwrap() {
                if o["path"] == "report.html" {
                    o["blake3"] = serde_json::Value::Null;
                    o["bytes"] = serde_json::Value::Null;
                }
            }
            v
        };
        assert_eq!(
            json(&l),
            json(&r),
            "evidence.json differs beyond the command and the root"
        );
        assert!(rs.contains(&u), "evidence.json names {u}");
    }
}

#[test]
fn s3_wrong_digest_and_missing_object_as_for_local() {
    let c = cases();
    compare("bad_digest", &c.bad_digest);
    compare("missing", &c.missing);
    let v = on_s3(&["verify", &url("bad_digest")]).expect(&[1]).run();
    assert!(v.stdout.contains("modified"), "{}", v.stdout);
    let v = on_s3(&["verify", &url("missing")]).expect(&[1]).run();
    assert!(v.stdout.contains("missing"), "{}", v.stdout);
}

fn refused(r: &Ran, words: &[&str]) {
    assert_eq!(r.code, 2, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for w in words {
        assert!(r.stderr.contains(w), "stderr lacks {w:?}: {}", r.stderr);
    }
    assert!(r.stderr.contains("hint:"), "{}", r.stderr);
}

#[test]
fn s3_wrong_credentials_are_refused_naming_the_url() {
    let s = s3_auth();
    let u = url("mini");
    // moto's signature check also misreads object_store's encoded list
    // query, so a right key is refused too there: the unknown key is told
    // apart by moto's own code for it (checked before any signature).
    let r = on(s, &["verify", &u])
        .env("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        .run();
    refused(&r, &[&u, "AWS_ACCESS_KEY_ID"]);
    let r = on(s, &["scope", &u, "--json"])
        .env("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        .run();
    refused(&r, &[&u, "AWS_SECRET_ACCESS_KEY", "InvalidAccessKeyId"]);
}

#[test]
fn unreachable_endpoint_fails_fast() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let u = url("mini");
    let r = on_s3(&["inspect", &u])
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("KVTRAIL_OBJECT_STORE_RETRIES", "1")
        .env("KVTRAIL_OBJECT_STORE_CONNECT_TIMEOUT", "2")
        .run();
    refused(&r, &[&u, "did not answer", "KVTRAIL_OBJECT_STORE_TIMEOUT"]);
    assert!(r.wall < Duration::from_secs(60), "{:?}", r.wall);
    let r = on_s3(&["inspect", &u])
        .env("KVTRAIL_OBJECT_STORE_TIMEOUT", "soon")
        .run();
    refused(
        &r,
        &[&format!("error: {u}:"), "KVTRAIL_OBJECT_STORE_TIMEOUT"],
    );
}

#[test]
fn a_bucket_without_the_trace_is_refused() {
    let r = on_s3(&["verify", "s3://empty/trace"]).run();
    refused(&r, &["s3://empty/trace", "no trace under this prefix"]);
    let r = on_s3(&["scope", &url("nosuch"), "--json"]).run();
    refused(&r, &[&url("nosuch"), "no trace under this prefix"]);
    let r = on_s3(&["inspect", "s3://nosuchbucket/trace"]).run();
    refused(&r, &["s3://nosuchbucket/trace"]);
}

#[test]
fn an_object_replaced_after_listing_is_refused_and_no_folder_is_left() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let u = url("changing");
    let r = on_s3(&["scope", &u, "--out", out.to_str().unwrap()]).run();
    refused(
        &r,
        &[
            &format!("{u}/kv/pool=0/part-00000.parquet"),
            "changed while kvtrail read it",
        ],
    );
    assert!(!out.exists(), "scope --out left {}", out.display());
}

#[test]
fn sql_reads_the_manifest_remotely_and_names_the_engines_urls() {
    let c = cases();
    let u = url("mini");
    let local = kvtrail([
        "sql",
        "--dialect",
        "duckdb",
        "--trace-path",
        c.mini.to_str().unwrap(),
    ])
    .expect(&[0])
    .run();
    let duck = on_s3(&["sql", "--dialect", "duckdb", "--trace-path", &u])
        .expect(&[0])
        .run();
    assert_eq!(as_local(&duck.stdout, &u, &c.mini), local.stdout);
    assert!(duck.stdout.contains("'s3://traces/mini/kv/**/*.parquet'"));
    let spark = on_s3(&["sql", "--dialect", "spark", "--trace-path", &u])
        .expect(&[0])
        .run();
    assert!(
        spark.stdout.contains("'s3a://traces/mini/kv'"),
        "{}",
        spark.stdout
    );
    assert!(!spark.stdout.contains("'s3://"), "{}", spark.stdout);
    let trino = on_s3(&["sql", "--dialect", "trino", "--trace-path", &u]).run();
    refused(&trino, &["Trino reads tables", "catalog.schema"]);
    let trino = on_s3(&[
        "sql",
        "--dialect",
        "trino",
        "--manifest",
        &u,
        "--trace-path",
        "hive.incident",
    ])
    .expect(&[0])
    .run();
    assert!(
        trino.stdout.contains("\"hive\".\"incident\""),
        "{}",
        trino.stdout
    );
    let az = kvtrail([
        "sql",
        "--dialect",
        "spark",
        "--trace-path",
        "az://c/t",
        "--pools",
        "0",
    ])
    .run();
    refused(&az, &["abfss://"]);
}

/// A static HTTP server over a copy of the trace; `changing`: the file
/// replaced after its first HEAD.
fn http(dir: &Path, changing: Option<&str>) -> Server {
    let mut args = vec!["http", dir.to_str().unwrap()];
    args.extend(changing);
    start(&args)
}

#[test]
fn http_results_equal_a_local_copy_and_a_change_is_refused() {
    let c = cases();
    let srv = http(c._tmp.path(), None);
    let u = format!("{}/mini", srv.endpoint);
    for args in [
        vec!["verify", "--json"],
        vec!["inspect", "--json"],
        vec!["scope", "--json"],
    ] {
        let remote = kvtrail([args[0], u.as_str(), args[1]])
            .timeout(Duration::from_secs(300))
            .run();
        let local = kvtrail([args[0], c.mini.to_str().unwrap(), args[1]]).run();
        same(&remote, &local, &u, &c.mini, &format!("http {}", args[0]));
    }
    let bad = format!("{}/bad_digest", srv.endpoint);
    let r = kvtrail(["verify", bad.as_str()]).expect(&[1]).run();
    assert!(r.stdout.contains("modified"), "{}", r.stdout);
    let r = kvtrail(["verify", &format!("{}/nosuch", srv.endpoint)]).run();
    refused(&r, &["nosuch/trace.json", "trace.json is missing"]);

    let changing = http(c._tmp.path(), Some("mini/kv/pool=1/part-00000.parquet"));
    let u = format!("{}/mini", changing.endpoint);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = kvtrail(["scope", u.as_str(), "--out", out.to_str().unwrap()])
        .timeout(Duration::from_secs(300))
        .run();
    refused(
        &r,
        &[
            &format!("{u}/kv/pool=1/part-00000.parquet"),
            "changed while kvtrail read it",
        ],
    );
    assert!(!out.exists(), "scope --out left {}", out.display());
}

/// A bare static server (no ETag, Range ignored: what `python -m
/// http.server` is) over the cases; `changing`: kv/pool=1 of `mini` served
/// altered on its first GET only ("first") or on every later GET ("later").
fn plain(changing: Option<&str>) -> Server {
    let c = cases();
    let mut args = vec!["plain", c._tmp.path().to_str().unwrap()];
    if let Some(when) = changing {
        args.extend(["mini/kv/pool=1/part-00000.parquet", when]);
    }
    start(&args)
}

/// verify, inspect and scope (`--json`) of the trace at `prefix` on a
/// server `serve` starts afresh for each command (its "first" and "later"
/// count one command's requests), against the local copy `dir`.
fn compare_http(serve: impl Fn() -> Server, prefix: &str, dir: &Path, what: &str) {
    for args in [
        vec!["verify", "--json"],
        vec!["inspect", "--json"],
        vec!["scope", "--json"],
    ] {
        let srv = serve();
        let u = format!("{}/{prefix}", srv.endpoint);
        let remote = kvtrail([args[0], u.as_str(), args[1]])
            .timeout(Duration::from_secs(300))
            .run();
        let local = kvtrail([args[0], dir.to_str().unwrap(), args[1]]).run();
        assert!(!remote.stderr.contains("panicked"), "{}", remote.stderr);
        same(&remote, &local, &u, dir, &format!("{what} {}", args[0]));
    }
}

/// A server that names no ETag cannot pin a read: each object is read
/// once (one GET, no Range) into a local copy that is hashed and replayed
/// alike, so what the evidence hashes is what the answer rests on, whatever
/// the server sends on later requests.
#[test]
fn http_without_etag_or_range_replays_the_bytes_it_hashed() {
    let c = cases();
    compare_http(|| plain(None), "mini", &c.mini, "plain");
    // Altered after the first GET: never seen.
    compare_http(|| plain(Some("later")), "mini", &c.mini, "later");
    // Altered on the first GET only: what was read is the altered file,
    // exactly as a local copy of it reads (a digest that differs from
    // trace.json's), never a mix.
    compare_http(|| plain(Some("first")), "mini", &c.flipped, "first");
    let srv = plain(Some("first"));
    let r = kvtrail(["verify", &format!("{}/mini", srv.endpoint)])
        .timeout(Duration::from_secs(300))
        .expect(&[1])
        .run();
    assert!(r.stdout.contains("modified"), "{}", r.stdout);
}

/// An object whose name a store or server percent-encodes (`%`) is asked
/// for as the listing (or trace.json) names it, on S3 and over HTTP.
#[test]
fn object_names_with_percent_signs_are_read_as_named() {
    let c = cases();
    compare("pct", &c.pct);
    compare_http(|| plain(None), "pct", &c.pct, "plain pct");
}

/// A URL with a user or password is refused without echoing the secret;
/// an over-long URL is refused, not a panic; a failed evidence read into
/// an existing empty --out folder leaves it empty.
#[test]
fn userinfo_long_urls_and_a_failed_run_into_an_empty_folder() {
    for u in [
        "http://alice:s3cr3t@127.0.0.1:9/mini",
        "s3://KEYID:s3cr3t@traces/mini",
    ] {
        let r = kvtrail(["verify", u]).run();
        refused(&r, &["names a user or password"]);
        assert!(!r.stderr.contains("s3cr3t"), "{}", r.stderr);
    }
    // The URL parser would resolve `.` and `..`: the prefix read would not
    // be the one reports name.
    for u in [
        "s3://traces/x/../mini",
        "s3://traces/./mini",
        "http://127.0.0.1:9/t/%2E%2e/mini",
    ] {
        let r = kvtrail(["verify", u]).run();
        refused(&r, &[u, "`.` or `..` segment"]);
    }
    // ...and drops tabs and line breaks, trims spaces, reads `\` as `/`.
    for u in [
        "s3://traces/evil/.\t./mini",
        "s3://traces/mini ",
        "s3://traces/mi\nni",
        "http://127.0.0.1:9/evil\\..\\mini",
    ] {
        let r = kvtrail(["verify", u]).run();
        refused(&r, &["space, control character or backslash"]);
    }
    // abfs(s) names the container before `@`: read as any URL (here from
    // the Azure emulator's address, where nothing answers).
    let abfss = "abfss://c@acct.dfs.core.windows.net/t";
    let r = kvtrail(["verify", abfss])
        .env("AZURE_STORAGE_USE_EMULATOR", "true")
        .env("KVTRAIL_OBJECT_STORE_RETRIES", "0")
        .run();
    refused(&r, &[abfss, "did not answer"]);
    assert!(!r.stderr.contains("user or password"), "{}", r.stderr);
    let long = format!("s3://{BUCKET}/{}t", "a/".repeat(22_000));
    for args in [vec!["verify", long.as_str()], vec!["scope", long.as_str()]] {
        let r = on_s3(&args).run();
        refused(&r, &["bytes long", "4096"]);
    }
    let flat = format!("http://127.0.0.1:9/{}", "a".repeat(70_000));
    let r = kvtrail(["inspect", flat.as_str()]).run();
    refused(&r, &["bytes long"]);
    // A file path in trace.json too long for a URL: refused before it is
    // asked for (over HTTP each listed file is asked for by name).
    let long = tempfile::tempdir().unwrap();
    let t = long.path().join("t");
    copy_dir(&cases().mini, &t);
    let tj = t.join("trace.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&tj).unwrap()).unwrap();
    let mut entry = m["files"][0].clone();
    entry["path"] = format!("kv/pool=1/{}.parquet", "a".repeat(70_000)).into();
    m["files"].as_array_mut().unwrap().push(entry);
    std::fs::write(&tj, serde_json::to_vec(&m).unwrap()).unwrap();
    let srv = start(&["plain", long.path().to_str().unwrap()]);
    let r = kvtrail(["verify", &format!("{}/t", srv.endpoint)]).run();
    refused(&r, &["names a file whose URL is", "bytes long"]);

    let c = cases();
    let changing = http(c._tmp.path(), Some("mini/kv/pool=1/part-00000.parquet"));
    let u = format!("{}/mini", changing.endpoint);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let r = kvtrail(["scope", u.as_str(), "--out", out.to_str().unwrap()])
        .timeout(Duration::from_secs(300))
        .run();
    refused(&r, &["changed while kvtrail read it"]);
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "scope --out left {left:?}");
}

/// A server that sends ETags but ignores Range (answers 200 with the whole
/// object) is refused with one message that says so (exit 2), not a
/// network hint, and not a message nested in another.
#[test]
fn a_server_ignoring_range_is_named_as_such() {
    let c = cases();
    let srv = start(&["http", c._tmp.path().to_str().unwrap(), "-", "norange"]);
    let u = format!("{}/mini", srv.endpoint);
    for cmd in ["verify", "scope"] {
        let r = kvtrail([cmd, u.as_str()])
            .env("KVTRAIL_OBJECT_STORE_RETRIES", "0")
            .timeout(Duration::from_secs(300))
            .run();
        refused(&r, &["ignores Range requests", &format!("{u}/trace.json")]);
        assert_eq!(r.stderr.matches("hint:").count(), 1, "{}", r.stderr);
        assert!(!r.stderr.contains("\\u{a}"), "{}", r.stderr);
    }
}

/// A store that ignores If-Match and serves other bytes under the ETag it
/// listed, after the object's first read: every command that reads the
/// object is refused (the bytes replayed must be the bytes hashed), and
/// scope leaves no folder. Before, scope replayed the altered bytes and
/// recorded the first read's digest.
#[test]
fn a_store_ignoring_if_match_cannot_swap_bytes_under_one_etag() {
    let c = cases();
    let rel = "mini/kv/pool=1/part-00000.parquet";
    let tmp = tempfile::tempdir().unwrap();
    for cmd in ["verify", "inspect", "scope"] {
        let srv = start(&["http", c._tmp.path().to_str().unwrap(), rel, "lies"]);
        let u = format!("{}/mini", srv.endpoint);
        let out = tmp.path().join(cmd);
        let mut args = vec![cmd, u.as_str()];
        if cmd == "scope" {
            args.extend(["--out", out.to_str().unwrap()]);
        }
        let r = kvtrail(args)
            .env("KVTRAIL_OBJECT_STORE_RETRIES", "0")
            .timeout(Duration::from_secs(300))
            .run();
        refused(
            &r,
            &[
                &format!("{u}/kv/pool=1/part-00000.parquet"),
                "changed while kvtrail read it",
                "other bytes than the object's first read",
            ],
        );
        assert!(!out.exists(), "{cmd} left {}", out.display());
    }
}

/// A store whose listing never ends (the same page token again, or new
/// tokens naming the same object again) is refused on the page that
/// repeats, not listed until a limit is reached.
#[test]
fn a_listing_that_never_ends_is_refused_at_once() {
    for what in ["token", "names"] {
        let srv = start(&["s3loop", what]);
        let r = s3_env(&srv, kvtrail(["verify", "s3://b/t"]))
            .timeout(Duration::from_secs(60))
            .run();
        refused(&r, &["s3://b/t", "cannot be listed", "page 2"]);
    }
    for (what, words) in [
        ("empty", &["100 pages in a row", "pages 2 to 101"][..]),
        ("longtoken", &["a page token of 70000 bytes"][..]),
        (
            "longname",
            &["an object of", "longer than any store allows"][..],
        ),
    ] {
        let srv = start(&["s3loop", what]);
        let r = s3_env(&srv, kvtrail(["verify", "s3://b/t"]))
            .timeout(Duration::from_secs(60))
            .run();
        refused(&r, &[&["s3://b/t", "cannot be listed"][..], words].concat());
        assert!(r.stderr.len() < 8192, "{} bytes of stderr", r.stderr.len());
    }
    // A size no trace file has: refused before any of it is asked for
    // (a list of block digests sized from it could not be allocated).
    let srv = start(&["s3loop", "hugesize"]);
    let r = s3_env(&srv, kvtrail(["inspect", "s3://b/t"]))
        .timeout(Duration::from_secs(60))
        .run();
    refused(&r, &["s3://b/t/trace.json", "18446744073709551615 bytes"]);
}

/// A listing page or an error answer of 40 MB is refused as too long,
/// without being held whole (the client bounds what it buffers), and the
/// server's text in the message is cut short.
#[test]
fn answers_too_long_to_be_a_listing_or_an_error_are_refused() {
    for what in ["huge", "error"] {
        let srv = start(&["s3loop", what]);
        let r = s3_env(&srv, kvtrail(["verify", "s3://b/t"]))
            .timeout(Duration::from_secs(60))
            .run();
        refused(&r, &["s3://b/t", "too long to be one"]);
        assert!(r.stderr.len() < 8192, "{} bytes of stderr", r.stderr.len());
    }
}
