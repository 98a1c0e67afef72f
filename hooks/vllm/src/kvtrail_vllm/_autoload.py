"""Imported by kvtrail_vllm.pth at interpreter start-up. Costs one
environment lookup when KVTRAIL_CAPTURE is unset; when it is set, installs
the hook (patches are applied lazily as vLLM's modules are imported)."""

import os

if os.environ.get("KVTRAIL_CAPTURE"):
    try:
        import kvtrail_vllm

        kvtrail_vllm.install()
    except Exception as e:  # never break the interpreter start-up
        import sys

        print(f"kvtrail_vllm: capture NOT enabled: {e}", file=sys.stderr)
