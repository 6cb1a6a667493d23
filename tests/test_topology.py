"""One topology value, "rank r of R on worker w of W": the formula for a replica's share exists once."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli, tiny_config, write_config

from tpugen.config import PodConfig
from tpugen.engine.topology import Topology, worker_topology
from tpugen.errors import InputError


def test_every_image_has_exactly_one_owner_across_workers_and_ranks():
    workers, ranks = 3, 4
    parts = [Topology(worker=w, workers=workers).with_rank(r, ranks) for w in range(workers) for r in range(ranks)]
    assert sorted(t.part for t in parts) == list(range(12)) and {t.parts for t in parts} == {12}
    # Worker w of W with rank r of R takes index % (W*R) == w*R + r.
    assert Topology(worker=1, workers=3).with_rank(2, 4).part == 6


def test_a_worker_without_ranks_is_one_part_of_its_pod():
    topology = worker_topology(PodConfig(num_workers=4), {"TPU_WORKER_ID": "3"})
    assert (topology.part, topology.parts) == (3, 4)
    assert topology.as_dict() == {
        "worker_index": 3,
        "num_workers": 4,
        "rank": 0,
        "ranks_per_worker": 1,
        "world_size": 4,
    }


def test_a_pod_worker_that_cannot_tell_its_index_is_refused_not_guessed():
    with pytest.raises(InputError, match="this worker's index is unknown"):
        worker_topology(PodConfig(num_workers=2), {})
    assert worker_topology(PodConfig(num_workers=2), {}, host_index=lambda: 1).worker == 1


def test_a_hand_run_with_a_pod_worker_count_and_no_index_is_refused_off_a_tpu(tmp_path, monkeypatch):
    # Before, torch_xla's host index (0 on any machine that is not a TPU pod host) was taken: a hand-run
    # `tpugen generate` with execution.pod.num_workers: 2 quietly made worker 0's half of the images.
    monkeypatch.delenv("TPU_WORKER_ID", raising=False)
    monkeypatch.delenv("CLOUD_TPU_TASK_ID", raising=False)
    config = tiny_config(tmp_path, execution={"backend": "xla", "pod": {"num_workers": 2}})
    result = run_cli("generate", write_config(tmp_path / "run.yaml", config), "--quiet")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: execution.pod: this worker's index is unknown: TPU_WORKER_ID is unset and PJRT_DEVICE=CPU has no "
        "pod host index; set execution.pod.worker_index or TPU_WORKER_ID"
    )
    assert not Path(config["output"]["dir"]).exists()
