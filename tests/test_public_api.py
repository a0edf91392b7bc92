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


def test_what_public_methods_return_is_importable_from_a_public_module():
    """PrefetchStats.verdict() returns a Verdict, defined in a private module and public in gpufeed.stats."""
    import gpufeed.stats

    verdict = gpufeed.PrefetchStats().verdict()
    assert type(verdict) is gpufeed.stats.Verdict and "Verdict" in gpufeed.stats.__all__
    assert sorted(gpufeed.stats.__all__) == gpufeed.stats.__all__
    assert all(getattr(gpufeed.stats, name).__doc__ for name in gpufeed.stats.__all__)
