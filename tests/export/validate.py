"""Independent checks of kvtrail's exports, run by tests/it/export.rs in the
venv of .ci/setup.d/55-export-validators.sh.

    validate.py ocsf FILE        # findings.ocsf.jsonl
    validate.py timesketch FILE  # timeline.jsonl

ocsf: every line is one event, validated against the JSON Schema that the
ocsf-json-schema package generates from the OCSF 1.8.0 schema export for
the event's class and metadata.profiles (jsonschema, draft 2020-12); plus
what the schema does not say: type_uid = class_uid * 100 + activity_id, no
null anywhere, an Incident Finding carries the "incident" profile and an
assignee or assignee_group.

timesketch: the file goes through Timesketch's own JSONL reader
(read_and_validate_jsonl), once as written and once with `timestamp`
removed (so the reader parses every `datetime` itself and would skip one it
cannot read); events out must equal lines in both times. Every `datetime`
carries a UTC offset, `timestamp` equals it in epoch microseconds, keys stay
under Timesketch's limits.

Prints one JSON object (counts) on success; exits 1 naming the line and
the problem otherwise.
"""

import datetime
import io
import json
import sys

OCSF_VERSION = "1.8.0"
# Timesketch: about 454 distinct keys per timeline (OpenSearch's mapping
# limit of 1000); values over 32,766 bytes are not indexed as keywords.
MAX_KEYS = 454
MAX_VALUE_BYTES = 32766
DROPPED_KEYS = {"_id", "_type", "_index", "_source"}


def fail(msg):
    print(msg, file=sys.stderr)
    sys.exit(1)


def lines_of(path):
    data = open(path, "rb").read()
    if not data:
        return []
    if not data.endswith(b"\n"):
        fail(f"{path}: the last line has no newline")
    lines = data[:-1].split(b"\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            fail(f"{path}: line {i} is blank")
    return [line.decode("utf-8") for line in lines]


def find_null(v, where):
    if v is None:
        return where
    if isinstance(v, dict):
        for k, x in v.items():
            w = find_null(x, f"{where}.{k}")
            if w:
                return w
    if isinstance(v, list):
        for i, x in enumerate(v):
            w = find_null(x, f"{where}[{i}]")
            if w:
                return w
    return None


def check_ocsf(path):
    import jsonschema
    from ocsf_json_schema import OcsfJsonSchemaEmbedded, get_ocsf_schema

    ocsf = OcsfJsonSchemaEmbedded(get_ocsf_schema(version=OCSF_VERSION))
    schemas = {}
    classes = {}
    lines = lines_of(path)
    for i, line in enumerate(lines, 1):
        ev = json.loads(line)
        if not isinstance(ev, dict):
            fail(f"line {i}: not an object")
        null = find_null(ev, "event")
        if null:
            fail(f"line {i}: null value at {null}")
        cls = ev.get("class_uid")
        profiles = sorted(ev.get("metadata", {}).get("profiles", []))
        key = (cls, tuple(profiles))
        if key not in schemas:
            name = ocsf.lookup_class_name_from_uid(cls)
            schemas[key] = jsonschema.Draft202012Validator(
                ocsf.get_class_schema(class_name=name, profiles=profiles)
            )
        errors = sorted(schemas[key].iter_errors(ev), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            fail(f"line {i}: OCSF {OCSF_VERSION} class {cls}: {'/'.join(map(str, e.path))}: {e.message}")
        if ev["type_uid"] != ev["class_uid"] * 100 + ev["activity_id"]:
            fail(f"line {i}: type_uid {ev['type_uid']} is not class_uid * 100 + activity_id")
        if ev["category_uid"] != 2:
            fail(f"line {i}: category_uid {ev['category_uid']} is not 2 (Findings)")
        if ev["metadata"]["version"] != OCSF_VERSION:
            fail(f"line {i}: metadata.version {ev['metadata']['version']!r}")
        if not isinstance(ev["time"], int) or isinstance(ev["time"], bool):
            fail(f"line {i}: time is not an integer")
        if cls == 2005:
            if "incident" not in profiles:
                fail(f"line {i}: an Incident Finding without the incident profile")
            if "assignee" not in ev and "assignee_group" not in ev:
                fail(f"line {i}: an Incident Finding without assignee or assignee_group")
        classes[str(cls)] = classes.get(str(cls), 0) + 1
    return {"lines": len(lines), "events": sum(classes.values()), "classes": classes}


def micros(dt):
    return (dt - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)) // datetime.timedelta(
        microseconds=1
    )


def timesketch_read(reader, text):
    try:
        return list(reader(io.StringIO(text)))
    except Exception as e:  # RuntimeError, DataIngestionError
        fail(f"Timesketch's reader refused the file: {e}")


def check_timesketch(path):
    from dateutil import parser
    from timesketch.lib.utils import read_and_validate_jsonl

    lines = lines_of(path)
    text = open(path, encoding="utf-8").read()
    as_read = timesketch_read(read_and_validate_jsonl, text)
    if len(as_read) != len(lines):
        fail(f"Timesketch's reader returned {len(as_read)} events for {len(lines)} lines")
    stripped = []
    keys = set()
    for i, line in enumerate(lines, 1):
        ev = json.loads(line)
        if not isinstance(ev, dict):
            fail(f"line {i}: not an object")
        null = find_null(ev, "line")
        if null:
            fail(f"line {i}: null value at {null}")
        for k in ("message", "datetime", "timestamp_desc"):
            if not isinstance(ev.get(k), str) or not ev[k]:
                fail(f"line {i}: {k} missing or not a non-empty string")
        try:
            dt = parser.isoparse(ev["datetime"])
        except (ValueError, OverflowError) as e:
            fail(f"line {i}: datetime {ev['datetime']!r} is not ISO 8601: {e}")
        if dt.tzinfo is None or dt.utcoffset() is None:
            fail(f"line {i}: datetime {ev['datetime']!r} has no UTC offset")
        if not isinstance(ev.get("timestamp"), int) or ev["timestamp"] != micros(dt):
            fail(f"line {i}: timestamp {ev.get('timestamp')!r} is not datetime {ev['datetime']!r} in epoch microseconds")
        for k, v in ev.items():
            if k in DROPPED_KEYS:
                fail(f"line {i}: key {k!r} would be dropped by Timesketch")
            if len(json.dumps(v, ensure_ascii=False).encode("utf-8")) > MAX_VALUE_BYTES:
                fail(f"line {i}: value of {k!r} is over {MAX_VALUE_BYTES} bytes")
        keys.update(ev.keys())
        del ev["timestamp"]
        stripped.append(json.dumps(ev))
    if len(keys) > MAX_KEYS:
        fail(f"{len(keys)} distinct keys, over Timesketch's limit of about {MAX_KEYS}")
    reparsed = timesketch_read(read_and_validate_jsonl, "\n".join(stripped) + "\n" if stripped else "")
    if len(reparsed) != len(lines):
        fail(f"without timestamp, Timesketch's reader kept {len(reparsed)} of {len(lines)} lines (a datetime it cannot parse)")
    for i, (ev, got) in enumerate(zip(as_read, reparsed), 1):
        # The reader's own conversion goes through a float: within 1 us.
        if abs(got["timestamp"] - ev["timestamp"]) > 1:
            fail(f"line {i}: Timesketch reads datetime as {got['timestamp']}, timestamp says {ev['timestamp']}")
    return {"lines": len(lines), "events": len(as_read), "keys": len(keys)}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("ocsf", "timesketch"):
        fail("usage: validate.py ocsf|timesketch FILE")
    check = check_ocsf if sys.argv[1] == "ocsf" else check_timesketch
    print(json.dumps(check(sys.argv[2]), sort_keys=True))


if __name__ == "__main__":
    main()
