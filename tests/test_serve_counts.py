"""What a server counts when its engines share one process (execution.mode: multi, an engine per device):
torch_xla keeps one compile count and one execution time for the whole process, so each engine's batch reads
its neighbours' work too. Compiles after warmup are counted once each however the batches overlap; the device's
time per step is not measured (None, NaN on /metrics) rather than every engine's added up; strict shapes, which
a neighbour's compile would trip, are refused at the start. Without a device: the counts are a fake backend's."""

from __future__ import annotations

import random
import threading

import pytest

from tpugen.backends.base import Counters
from tpugen.engine.step_clock import StepClock
from tpugen.errors import InputError
from tpugen.modes.serve.device_loops import CompileLedger


class ProcessCount:
    """One process-wide compile count that several engines' backends read, as torch_xla's metrics are."""

    def __init__(self) -> None:
        self.compiles = 0
        self.execute_seconds = 0.0

    def backend(self):
        count = self

        class Backend:
            def counters(self) -> Counters:
                return Counters(
                    compiles=count.compiles,
                    compile_seconds=None,
                    executions=None,
                    transfers_to_host=None,
                    execute_seconds=count.execute_seconds,
                )

            def wait(self) -> None:
                pass

        return Backend()


def test_a_compile_two_engines_batches_both_saw_counts_once():
    count = ProcessCount()
    first, second = count.backend(), count.backend()
    ledger = CompileLedger()
    a = ledger.open(first)
    count.compiles += 1  # the first engine's new shape compiles...
    b = ledger.open(second)
    count.compiles += 2  # ...and, while the second engine's batch runs too, two more graphs
    assert ledger.close(b, second) == 2  # the second batch's window saw two compiles
    assert ledger.close(a, first) == 1  # the first saw three; two were counted already
    # Each batch's own reading, as the server counted before: 3 + 2 for three compiles.
    c = ledger.open(first)
    assert ledger.close(c, first) == 0


@pytest.mark.parametrize("seed", range(20))
def test_overlapping_batches_count_every_compile_once_in_any_order(seed):
    # Batches of three engines start, compile and end in a random order; some fail. Whatever the order, the
    # counts added up are the compiles that fell inside some successful batch's window, each once.
    rng = random.Random(seed)
    count = ProcessCount()
    engines = [count.backend() for _ in range(3)]
    ledger = CompileLedger()
    open_windows: dict[int, tuple[object, int]] = {}  # engine -> (its window, the count at its start)
    windows: list[tuple[int, int]] = []  # successful windows as (start, end) counts
    counted = 0
    for _ in range(60):
        engine = rng.randrange(3)
        if engine in open_windows and rng.random() < 0.5:
            window, start = open_windows.pop(engine)
            if rng.random() < 0.2:
                ledger.close(window)  # a failed batch counts nothing
            else:
                counted += ledger.close(window, engines[engine])
                windows.append((start, count.compiles))
        elif engine not in open_windows:
            open_windows[engine] = (ledger.open(engines[engine]), count.compiles)
        else:
            count.compiles += rng.randrange(3)
    for engine, (window, start) in open_windows.items():
        counted += ledger.close(window, engines[engine])
        windows.append((start, count.compiles))
    # The n-th compile took the count from n - 1 to n: inside a window that started at or before n - 1, ended at n or after.
    inside = {n for n in range(1, count.compiles + 1) for start, end in windows if start < n <= end}
    assert counted == len(inside)


def test_the_ledger_takes_concurrent_batches():
    count = ProcessCount()
    ledger = CompileLedger()
    lock = threading.Lock()
    totals = []

    def engine() -> None:
        backend = count.backend()
        for _ in range(200):
            window = ledger.open(backend)
            with lock:
                count.compiles += 1
            totals.append(ledger.close(window, backend))

    threads = [threading.Thread(target=engine) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(totals) == count.compiles == 800


def test_a_backend_without_counts_opens_no_window():
    class Uncounted:
        def counters(self):
            return None

    ledger = CompileLedger()
    assert ledger.open(Uncounted()) is None and ledger.close(None, Uncounted()) == 0


def test_device_time_per_step_is_not_read_where_neighbours_share_the_counts():
    count = ProcessCount()
    timings = {}
    for measured in (True, False):
        clock = StepClock(count.backend(), device_measured=measured)
        clock.loop_started()
        for _ in range(4):
            clock.step_handed_off()
            count.execute_seconds += 0.25  # a neighbour's executions land in the same process-wide sum
        clock.loop_ended()
        timings[measured] = clock.timing()
    assert timings[True].device_ms_per_step > 0 and timings[True].host_ms_per_step is not None
    assert timings[False].device_ms_per_step is None and timings[False].host_ms_per_step is not None


def test_a_multi_mode_server_refuses_strict_shapes_at_the_start(tmp_path):
    from conftest import tiny_config, write_config

    from tpugen.config import load_config
    from tpugen.modes.serve.server import check_start

    config = tiny_config(tmp_path, execution={"mode": "multi", "cores": 2, "strict_shapes": True})
    path = write_config(tmp_path / "serve.yaml", config)
    with pytest.raises(InputError) as refused:
        check_start(load_config(path, prompts_required=False), "127.0.0.1", None)
    assert refused.value.lines == [
        "execution.strict_shapes: under execution.mode: multi the server's engines share one process, whose compile "
        "count torch_xla keeps for the process: a compile for one device's request would stop a run on another; "
        "serve with strict_shapes: false"
    ]


def test_a_reading_that_raises_leaves_no_window_open():
    count = ProcessCount()
    backend = count.backend()
    ledger = CompileLedger()
    window = ledger.open(backend)
    other = ledger.open(backend)

    class Broken:
        def counters(self):
            raise RuntimeError("the device is gone")

    with pytest.raises(RuntimeError):
        ledger.close(window, Broken())
    assert ledger.close(window) == 0  # the failed batch closing it again: nothing, no error
    count.compiles += 2
    assert ledger.close(other, backend) == 2
    assert ledger._open == {} and ledger._counted == []  # nothing left pinned
