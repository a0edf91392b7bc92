"""Conformance tests that every ``BatchSource`` implementation runs: subclass ``SourceContract``.

Example:
    >>> class TestMySource(SourceContract):                       # doctest: +SKIP
    ...     def make_source(self, tmp_path):
    ...         data = np.arange(300, dtype=np.float32).reshape(100, 3)
    ...         np.save(tmp_path / "x.npy", data)
    ...         return RawSource(tmp_path / "x.npy"), {"x": data}
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from gpufeed import host_memory
from gpufeed.sources.base import BatchSource, Rows


class SourceContract:
    """The behaviour every source must have; a test class per source subclasses it.

    Subclasses implement ``make_source(tmp_path)`` and return ``(source, expected)``, where ``expected``
    maps each field name to a numpy array of all samples (``expected[name][i]`` is sample ``i``; only its
    bytes, shape and item size are compared, so a ``uint16`` array can stand for ``bfloat16`` samples).
    Use at least 20 samples so the tests can pick interesting rows.

    The tests read into plain CPU tensors (pinned ones when CUDA is available) for host sources and CUDA
    tensors for ``reads_to == "device"`` sources. A source that sets ``picklable = True`` must work after
    a pickle round trip; one that sets ``fork_safe`` (defaults to ``picklable``) must work in a child made
    by ``os.fork`` after the parent has read.
    """

    def make_source(self, tmp_path: Path) -> tuple[BatchSource, Mapping[str, np.ndarray]]:
        raise NotImplementedError("subclasses return (source, {field name: all samples as numpy})")

    @pytest.fixture
    def case(self, tmp_path: Path) -> Iterator[tuple[BatchSource, Mapping[str, np.ndarray]]]:
        source, expected = self.make_source(tmp_path)
        try:
            yield source, expected
        finally:
            source.close()

    # ---- helpers -------------------------------------------------------------------------------------

    @staticmethod
    def empty_out(
        source: BatchSource, n: int, fill: int = 0xA5, pin: bool | None = None
    ) -> dict[str, torch.Tensor]:
        """Output tensors for ``n`` rows, on the memory the source writes to, filled with a sentinel byte.

        Host tensors are pinned when CUDA is available, unless ``pin=False`` (a forked child cannot use CUDA).
        """
        device = "cuda" if source.reads_to == "device" else "cpu"
        if pin is None:
            pin = device == "cpu" and torch.cuda.is_available()
        out = {}
        for name, f in source.fields.items():
            t = torch.empty((n, *f.shape), dtype=f.dtype, device=device)
            if pin:
                t = host_memory.pin(t)
            if t.numel():
                t.view(-1).view(torch.uint8).fill_(fill)
            out[name] = t
        return out

    @staticmethod
    def as_bytes(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    @staticmethod
    def expected_bytes(expected: Mapping[str, np.ndarray], name: str, rows: Rows) -> np.ndarray:
        idx = np.arange(rows.start, rows.stop, rows.step) if isinstance(rows, range) else np.asarray(rows)
        return np.ascontiguousarray(expected[name][idx]).reshape(-1).view(np.uint8)

    def read(self, source: BatchSource, rows: Rows, pin: bool | None = None) -> dict[str, torch.Tensor]:
        out = self.empty_out(source, len(rows), pin=pin)
        source.read(rows, out)
        if source.reads_to == "device":
            torch.cuda.synchronize()
        return out

    def assert_reads(self, source: BatchSource, expected: Mapping[str, np.ndarray], rows: Rows) -> None:
        out = self.read(source, rows)
        for name in source.fields:
            got, want = self.as_bytes(out[name]), self.expected_bytes(expected, name, rows)
            assert np.array_equal(got, want), f"field {name!r}: bytes differ for rows {rows!r}"

    # ---- the contract -------------------------------------------------------------------------------

    def test_is_a_batch_source(self, case):
        source, _ = case
        assert isinstance(source, BatchSource)
        assert source.reads_to in ("host", "device")

    def test_fields_match_expected(self, case):
        source, expected = case
        assert set(source.fields) == set(expected)
        for name, f in source.fields.items():
            assert f.name == name
            assert tuple(f.shape) == expected[name].shape[1:]
            assert torch.empty((), dtype=f.dtype).element_size() == expected[name].dtype.itemsize

    def test_len_matches_expected(self, case):
        source, expected = case
        for arr in expected.values():
            assert len(source) == len(arr)
        assert len(source) >= 2

    def test_contiguous_ranges(self, case):
        source, expected = case
        n = len(source)
        for a, b in [(0, min(n, 7)), (n // 3, n // 3 + max(1, n // 4)), (n - 5 if n > 5 else 0, n)]:
            self.assert_reads(source, expected, range(a, b))

    def test_sorted_random_rows(self, case):
        source, expected = case
        n = len(source)
        rng = np.random.default_rng(0)
        for k in (2, max(2, n // 8), max(2, n // 2)):
            rows = np.sort(rng.choice(n, size=min(k, n), replace=False)).astype(np.int64)
            self.assert_reads(source, expected, rows)

    def test_unsorted_rows_come_in_the_given_order(self, case):
        source, expected = case
        n = len(source)
        rows = np.array([n - 1, 0, n // 2, 1, n // 2 + 1], dtype=np.int64)
        self.assert_reads(source, expected, rows)

    def test_single_rows(self, case):
        source, expected = case
        for i in (0, 1, len(source) // 2):
            self.assert_reads(source, expected, range(i, i + 1))
            self.assert_reads(source, expected, np.array([i], dtype=np.int64))

    def test_last_row(self, case):
        source, expected = case
        n = len(source)
        self.assert_reads(source, expected, range(n - 1, n))
        self.assert_reads(source, expected, np.array([n - 1], dtype=np.int64))

    def test_all_rows(self, case):
        source, expected = case
        self.assert_reads(source, expected, range(len(source)))
        self.assert_reads(source, expected, np.arange(len(source), dtype=np.int64))

    def test_no_rows_is_a_no_op(self, case):
        source, _ = case
        source.read(range(0, 0), self.empty_out(source, 0))
        source.read(np.zeros(0, dtype=np.int64), self.empty_out(source, 0))

    def test_writes_only_the_first_len_rows_of_out(self, case):
        source, expected = case
        out = self.empty_out(source, 6)
        source.read(range(1, 4), out)
        if source.reads_to == "device":
            torch.cuda.synchronize()
        for name in source.fields:
            got = self.as_bytes(out[name])
            head = self.expected_bytes(expected, name, range(1, 4))
            assert np.array_equal(got[: head.size], head)
            assert (got[head.size :] == 0xA5).all(), "read wrote past len(rows) rows of out"

    def test_out_of_range_rows_raise_index_error(self, case):
        source, _ = case
        n = len(source)
        for rows in (range(n - 1, n + 1), np.array([0, n], dtype=np.int64), np.array([-1], dtype=np.int64)):
            with pytest.raises(IndexError):
                source.read(rows, self.empty_out(source, len(rows)))

    def test_too_small_out_raises_value_error(self, case):
        source, _ = case
        with pytest.raises(ValueError):
            source.read(range(0, 2), self.empty_out(source, 1))

    def test_wrong_out_dtype_or_missing_field_raises_value_error(self, case):
        source, _ = case
        name, f = next(iter(source.fields.items()))
        out = self.empty_out(source, 2)
        other = torch.float64 if f.dtype != torch.float64 else torch.int32
        out[name] = torch.empty((2, *f.shape), dtype=other, device=out[name].device)
        with pytest.raises(ValueError):
            source.read(range(0, 2), out)
        out.pop(name)
        with pytest.raises(ValueError):
            source.read(range(0, 2), out)

    def test_concurrent_reads(self, case):
        source, expected = case
        n = len(source)
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for _ in range(15):
                    k = int(rng.integers(1, n + 1))
                    if rng.random() < 0.5:
                        a = int(rng.integers(0, n - k + 1))
                        rows: Rows = range(a, a + k)
                    else:
                        rows = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
                    self.assert_reads(source, expected, rows)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]

    def test_close_is_idempotent_and_reads_reopen(self, case):
        source, expected = case
        self.assert_reads(source, expected, range(0, 2))
        source.close()
        source.close()
        self.assert_reads(source, expected, range(0, 2))

    def test_pickle_round_trip(self, case):
        source, expected = case
        if not getattr(source, "picklable", False):
            pytest.skip("source does not claim picklable")
        self.assert_reads(source, expected, range(0, 2))  # the parent has handles open
        clone = pickle.loads(pickle.dumps(source))
        try:
            assert len(clone) == len(source) and dict(clone.fields) == dict(source.fields)
            self.assert_reads(clone, expected, range(len(source)))
        finally:
            clone.close()

    def test_forked_child_reads(self, case):
        source, expected = case
        if not getattr(source, "fork_safe", getattr(source, "picklable", False)) or not hasattr(os, "fork"):
            pytest.skip("source does not claim to work in a forked child")
        n = len(source)
        rows = np.array(sorted({0, 1, n // 2, n - 1}), dtype=np.int64)
        self.assert_reads(source, expected, rows)  # handles are open in the parent before the fork
        want = hashlib.sha256(
            b"".join(self.expected_bytes(expected, name, rows).tobytes() for name in source.fields)
        ).hexdigest()
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads alive (Python 3.12)
            pid = os.fork()
        if pid == 0:  # child: never return into pytest
            code = 1
            try:
                os.close(r)
                out = self.read(source, rows, pin=False)  # no CUDA after fork
                digest = hashlib.sha256(b"".join(self.as_bytes(out[nm]).tobytes() for nm in source.fields))
                os.write(w, digest.hexdigest().encode())
                code = 0
            except BaseException as exc:
                os.write(w, f"error: {exc!r}".encode()[:4000])
            finally:
                os._exit(code)
        os.close(w)
        got = _read_all(r, timeout=30.0)
        if got.startswith("timeout"):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert got == want, f"child read differs or failed: {got}"
        assert os.waitstatus_to_exitcode(status) == 0


def _read_all(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout: the child did not answer"
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks).decode(errors="replace")
            chunks.append(chunk)
    finally:
        os.close(fd)
