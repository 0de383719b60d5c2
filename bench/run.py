"""The JetSpec benchmark (`jetspec-hf bench`) from a source checkout: `python bench/run.py [options]`.

Every option and the whole method list are in `jetspec_hf/bench.py` (`python bench/run.py --help`); results go to
`docs/benchmark_results.md`, `docs/benchmark_results.json` and `docs/benchmark.png` (see docs/benchmarks.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetspec_hf.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="python bench/run.py"))
