import json
import subprocess
import sys

import gpufeed


def test_all_is_sorted_and_complete():
    assert sorted(gpufeed.__all__) == gpufeed.__all__
    for name in gpufeed.__all__:
        obj = getattr(gpufeed, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_import_loads_no_optional_backend():
    code = ("import sys, json, gpufeed; print(json.dumps([m for m in "
            "('h5py', 'kvikio', 'cupy', 'nvtx', 'torchdata', 'matplotlib', 'lightning') "
            "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
