"""Local object stores for tests/it/object_store.rs, on 127.0.0.1 at a free
port: moto's S3 server (with credentials checked) or a static HTTP server
with Range, ETag and If-Match.

Usage:
  server.py s3 SPEC.json     moto in server mode; SPEC uploads traces
  server.py http ROOT [REL]  serves folder ROOT; REL: see "changing" below
                             ("-" for none); a third argument "norange":
                             Range ignored (200, the whole file); "lies":
                             REL is not replaced after its HEAD but served
                             altered on every GET after its first, under
                             its first ETag, If-Match ignored (a store
                             that does not honour If-Match)
  server.py plain ROOT [REL WHEN]
                             serves folder ROOT as a bare static server
                             does: no ETag, Range ignored (200, the whole
                             file); REL served altered (one byte flipped,
                             same size) on its first GET only (WHEN
                             "first") or on every GET after the first
                             ("later")
  server.py s3loop WHAT        an S3 endpoint whose listing never ends:
                             every ListObjectsV2 page is truncated and
                             names one object under the asked prefix;
                             WHAT "token": every page gives the same next
                             token; "names": each page a new token, the
                             same object again; "huge": one page of 40 MB
                             (one name of that length); "error": a 403
                             whose body is 40 MB; "empty": every page
                             empty, each with a new token; "longtoken":
                             a 70,000-byte token; "longname": one object
                             of a 70,000-byte name; "hugesize": trace.json
                             listed as 2^64-1 bytes, then the page ends

SPEC.json: {"bucket": NAME, "empty_bucket": NAME, "auth": BOOL,
            "uploads": [{"dir": LOCAL_TRACE, "prefix": PREFIX,
                         "only": [REL, ...] (optional)}, ...],
            "changing": PREFIX/REL or null}
"auth": credentials checked (moto's IAM); else any key is taken.

Prints one JSON line on stdout once ready ({"endpoint": URL, and for s3
"key_id", "secret"}), then serves until stdin closes (the test's end).

"changing": the object replaced (same size, one byte flipped, so only its
ETag tells) right after the trace is listed: for s3, after a ListObjects
request under its prefix; for http (which cannot list), after its first
HEAD. Every later read of it must be refused by kvtrail.
"""
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def flip(data):
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


def wait_stdin_then_exit(server):
    sys.stdin.read()
    server.shutdown()
    os._exit(0)


def serve_s3(spec_path):
    spec = json.load(open(spec_path))
    auth = spec.get("auth", False)
    if auth:
        # Credentials are checked from the fourth request on (the first
        # three create the IAM user whose key the tests use). moto's
        # signature check misreads keys holding `=` (Hive folders), so a
        # server with credentials checked holds only such keys' neighbours.
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *a, **k):
            pass

    app = DomainDispatcherApplication(create_backend_app)
    state = {"changed": False, "creds": None}
    changing = spec.get("changing")

    def wrapped(environ, start_response):
        out = app(environ, start_response)
        q = environ.get("QUERY_STRING", "")
        if changing and not state["changed"] and "list-type=2" in q:
            prefix = changing.split("/", 1)[0]
            if "prefix=" + prefix in q:
                state["changed"] = True
                body = b"".join(out)
                s3 = client("s3")
                key = changing
                data = s3.get_object(Bucket=spec["bucket"], Key=key)["Body"].read()
                s3.put_object(Bucket=spec["bucket"], Key=key, Body=flip(data))
                return [body]
        return out

    srv = make_server("127.0.0.1", 0, wrapped, threaded=True, request_handler=Quiet)
    endpoint = "http://127.0.0.1:%d" % srv.server_port
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def client(kind, creds=None):
        creds = creds or state["creds"]
        return boto3.client(
            kind,
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=creds[0],
            aws_secret_access_key=creds[1],
        )

    if auth:
        iam = client("iam", ("AKIAIOSFODNN7EXAMPLE", "bootstrap"))
        iam.create_user(UserName="kvtrail-test")
        key = iam.create_access_key(UserName="kvtrail-test")["AccessKey"]
        iam.put_user_policy(
            UserName="kvtrail-test",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        state["creds"] = (key["AccessKeyId"], key["SecretAccessKey"])
    else:
        state["creds"] = ("AKIAKVTRAILTEST00000", "kvtrail-test-secret")
    s3 = client("s3")
    s3.create_bucket(Bucket=spec["bucket"])
    if spec.get("empty_bucket"):
        s3.create_bucket(Bucket=spec["empty_bucket"])
    for up in spec.get("uploads", []):
        root = up["dir"]
        for d, _, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                rel = os.path.relpath(p, root).replace(os.sep, "/")
                if up.get("only") and rel not in up["only"]:
                    continue
                s3.upload_file(p, spec["bucket"], up["prefix"] + "/" + rel)
    print(
        json.dumps({"endpoint": endpoint, "key_id": state["creds"][0], "secret": state["creds"][1]}),
        flush=True,
    )
    wait_stdin_then_exit(srv)


def read_under(root, path):
    """The request path's file under root: (its relative path, its bytes or
    None when it is not a file there)."""
    rel = urllib.parse.unquote(path.split("?", 1)[0]).lstrip("/")
    p = os.path.realpath(os.path.join(root, rel))
    if not p.startswith(os.path.realpath(root) + os.sep) or not os.path.isfile(p):
        return rel, None
    with open(p, "rb") as f:
        return rel, f.read()


def serve(handler):
    """Serves handler on 127.0.0.1 at a free port; prints the ready line."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps({"endpoint": "http://127.0.0.1:%d" % srv.server_port}), flush=True)
    wait_stdin_then_exit(srv)


def serve_http(root, changing, mode=None):
    norange = mode == "norange"
    lies = mode == "lies"
    overlay = {}
    gets = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def body(self):
            rel, data = read_under(root, self.path)
            with lock:
                return rel, overlay.get(rel, data)

        def not_found(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def headers_for(self, data, etag=None):
            etag = etag or '"%s"' % hashlib.md5(data).hexdigest()
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", formatdate(1_700_000_000, usegmt=True))
            self.send_header("Accept-Ranges", "bytes")
            return etag

        def do_HEAD(self):
            rel, data = self.body()
            if data is None:
                return self.not_found()
            self.send_response(200)
            self.headers_for(data)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if changing == rel and not lies:
                with lock:
                    overlay.setdefault(rel, flip(data))

        def do_GET(self):
            rel, data = self.body()
            if data is None:
                return self.not_found()
            etag = '"%s"' % hashlib.md5(data).hexdigest()
            if lies and rel == changing:
                with lock:
                    gets[rel] = gets.get(rel, 0) + 1
                    later = gets[rel] > 1
                if later:
                    data = flip(data)
            want = self.headers.get("If-Match")
            if want is not None and want != etag:
                self.send_response(412)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            rng = None if norange else self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, b = rng[6:].split("-", 1)
                start = int(a)
                end = min(int(b), len(data) - 1) if b else len(data) - 1
                part = data[start : end + 1]
                self.send_response(206)
                self.headers_for(data, etag)
                self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end, len(data)))
            else:
                part = data
                self.send_response(200)
                self.headers_for(data, etag)
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            self.wfile.write(part)

    serve(Handler)


def serve_plain(root, changing, when):
    gets = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def answer(self, head):
            rel, data = read_under(root, self.path)
            if data is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if not head:
                with lock:
                    gets[rel] = gets.get(rel, 0) + 1
                    n = gets[rel]
                if rel == changing and ((when == "first") == (n == 1)):
                    data = flip(data)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def do_HEAD(self):
            self.answer(True)

        def do_GET(self):
            self.answer(False)

    serve(Handler)


def serve_s3loop(what):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            prefix = q.get("prefix", [""])[0]
            page = int(q.get("continuation-token", ["0"])[0])
            token = "1" if what == "token" else str(page + 1)
            if what == "longtoken":
                token = "9" * 70000
            name = "trace.json"
            if what == "longname":
                name = "kv/pool=0/%s.parquet" % ("a" * 70000)
            size = 18446744073709551615 if what == "hugesize" else 10
            truncated = "false" if what == "hugesize" else "true"
            contents = (
                "<Contents><Key>%s%s</Key>"
                "<LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>&quot;e&quot;</ETag>"
                "<Size>%d</Size><StorageClass>STANDARD</StorageClass></Contents>" % (prefix, name, size)
            )
            if what == "empty" and page > 0:
                contents = ""
            next_token = "" if what == "hugesize" else "<NextContinuationToken>%s</NextContinuationToken>" % token
            if what in ("huge", "error"):
                big = b"<Error><Code>AccessDenied</Code><Message>" + b"x" * (40 << 20)
                self.send_response(403 if what == "error" else 200)
                self.send_header("Content-Length", str(len(big)))
                self.end_headers()
                try:
                    self.wfile.write(big)
                except OSError:
                    pass
                return
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                "<Name>b</Name><Prefix>%s</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
                "<IsTruncated>%s</IsTruncated>%s%s</ListBucketResult>"
                % (prefix, truncated, contents, next_token)
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    serve(Handler)


def main():
    # The tests end the server by closing stdin; a lost parent ends it too.
    threading.Thread(target=lambda: (time.sleep(600), os._exit(3)), daemon=True).start()
    if sys.argv[1] == "s3":
        serve_s3(sys.argv[2])
    elif sys.argv[1] == "s3loop":
        serve_s3loop(sys.argv[2])
    elif sys.argv[1] == "plain":
        rest = sys.argv[3:] + [None, None]
        serve_plain(sys.argv[2], rest[0], rest[1])
    else:
        changing = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
        serve_http(sys.argv[2], changing, sys.argv[4] if len(sys.argv) > 4 else None)


if __name__ == "__main__":
    main()
