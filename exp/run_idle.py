"""bench_loops with gpufeed's stream choice printed at each runner's close (experiment)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loops as bl  # noqa: E402

_close = bl.Runner.close


def close(self):
    if self.method == "gpufeed":
        st, c = self.keep.stats, self.keep._stage.costs
        print(f"GPUFEED loop_stream={st.loop_stream_batches}/{st.batches} idle_ms={c.idle_s * 1e3:.2f} "
              f"loop_MiB={c.loop_bytes / 2**20:.1f} calls_us={(c.calls_s or 0) * 1e6:.0f} "
              f"startup_s={st.startup_s:.2f} wall_s={st.wall_s:.2f}", flush=True)
    _close(self)


bl.Runner.close = close
sys.exit(bl.main(sys.argv[1:]))
