"""The guard on SGLang 0.5.19's real classes (tests/it/guard.rs): the
scenario of record_driver.py (the seed's path: C's over-long prompt becomes
a 1-token placeholder on prefill, decode preallocates 30 pages and reads
them; D's decode radix-tree hit on C's pages, one of them stale), with the
guard as KVTRAIL_GUARD / KVTRAIL_GUARD_UNKNOWN say.

    python guard_driver.py SOCKET

Under abort, C's prebuilt check finds other requests' KV in the slots it
is about to read: the hook sets the real FINISH_ABORT as to_finish, and the
real Req.update_finish_state ends C with it before any decode forward.
Under alert, C runs (and the alert names its sources). A and B (plain PD
requests: their transferred KV is their own) never trip it.

Prints one JSON line: record_driver's facts, the guard's counters and its
alerts.
"""

import json
import sys

import torch

import kvtrail_sglang as kh
import record_driver as rd


def main():
    sock = sys.argv[1]
    rd.patch_kernels()
    kh.install(capture="unix:" + sock, pools=[0, 1], roles={0: "prefill", 1: "decode"},
               per_pool_connections=True, worker="guard-driver")
    P = rd.Side(0, rd.P_SIZE, "prefill")
    D = rd.Side(1, rd.D_SIZE, "decode")
    facts = {}
    rd.run_request(P, D, "A", 40, 1001, "tenant-a", 1, facts)
    rd.run_request(P, D, "B", 56, 1002, "tenant-b", 2, facts)
    rd.run_request(P, D, "C", 120, 1003, "tenant-c", 3, facts, tree_keep=8)
    c_pages = torch.tensor(facts["C"]["decode_prefix_slots"], dtype=torch.int64)
    rd.run_request(P, D, "D", 40, 1004, "tenant-d", 3, facts, decode_prefix=c_pages)
    kh.flush()
    facts["guard"] = kh.guard_stats()
    facts["alerts"] = kh.guard_alerts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts, sort_keys=True))


if __name__ == "__main__":
    main()
