"""node/banner.setup_logging: where the runtime's and the trainer's log lines go on each rank.

Rank 0: both on stderr, INFO included (the trainer's INFO lines, e.g. a pruned checkpoint, used to go nowhere).
Other ranks: the runtime's lines in logs/rank-N.log; only the trainer's warnings on stderr, as before."""

from __future__ import annotations

import logging

import pytest

from swiftslurm.node.banner import rank_log_path, setup_logging
from swiftslurm.slurm.distenv import DistEnv


@pytest.fixture(autouse=True)
def restore_loggers():
    """setup_logging changes process-wide loggers; other tests (caplog) need them as they were."""
    saved = {name: (lg.handlers[:], lg.level, lg.propagate)
             for name in ("swiftslurm.train", "swiftslurm.runtime") for lg in [logging.getLogger(name)]}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        for handler in lg.handlers:
            if handler not in handlers:
                handler.close()
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def dist(rank: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, nnodes=1,
                   nodes=("n1",), node="n1", master_addr="127.0.0.1", master_port=29500, job_id="7", requeue_id="7",
                   array_task_id=None, restart_count=0, gpus=(), executor="local")


def test_rank0_shows_the_trainers_info_lines_once_with_the_rank_prefix(tmp_path, capsys):
    setup_logging(dist(0), str(tmp_path))
    setup_logging(dist(0), str(tmp_path))  # a rerun in the same process replaces, not adds
    logging.getLogger("swiftslurm.train").info("pruned old checkpoint %s", "checkpoint-4")
    logging.getLogger("swiftslurm.runtime").info("hello")
    err = capsys.readouterr().err
    assert err.count("pruned old checkpoint checkpoint-4") == 1 and "[rank 0 n1] INFO pruned old checkpoint" in err
    assert err.count("hello") == 1


def test_other_ranks_keep_runtime_lines_in_their_file_and_train_warnings_on_stderr(tmp_path, capsys):
    setup_logging(dist(1), str(tmp_path))
    logging.getLogger("swiftslurm.train").info("pruned old checkpoint %s", "checkpoint-4")
    logging.getLogger("swiftslurm.train").warning("walltime stop: saving at step %d", 7)
    logging.getLogger("swiftslurm.runtime").info("hello from rank 1")
    for handler in logging.getLogger("swiftslurm.runtime").handlers:
        handler.flush()
    err = capsys.readouterr().err
    assert "pruned old checkpoint" not in err
    assert "[rank 1 n1] WARNING walltime stop: saving at step 7" in err
    text = rank_log_path(str(tmp_path), 1).read_text()
    assert "hello from rank 1" in text and "walltime stop" not in text and "hello from rank 1" not in err
