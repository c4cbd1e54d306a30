"""Verified checkpoints: two-phase commit with a checksummed manifest, verification, resume discovery, retention.

    from swiftslurm import checkpoint as ck
    stage = ck.prepare_staging(out, step)        # == ck.staging_dir(out, step), emptied and created
    ... every rank writes its files into stage; barrier ...
    ck.commit(stage, ck.final_dir(out, step), algo="xxh3", meta={...})   # rank 0
    ck.prune(out, keep)                                                  # rank 0
    resume_from = ck.newest_verified(out)                                # at every start (one process)
    resume_from = ck.verified_split(out, rank, world, node, exchange)    # ... or hashed by every rank at once
    ck.agree_resume_point(out, rank, node, exchange, decide)             # ... and the same on every rank

See docs/checkpoints.md.
"""

from . import savetime
from .best import best_checkpoint, point_best
from .commit import atomic_write_text, collect_rank_hashes, commit, crash_point, hash_own_files, prepare_staging, publish_rank_hashes
from .discover import list_checkpoints, newest_verified, prune
from .manifest import MANIFEST_NAME, Manifest, ManifestError, algo_name, hash_files, read_manifest
from .names import final_dir, staging_dir, step_of
from .ranks.agree import Exchange, SingleRank, agree_resume_point, readable_problem
from .ranks.split import verified_split
from .verify import VerifyResult, verify

__all__ = [
    "savetime",
    "Exchange",
    "SingleRank",
    "agree_resume_point",
    "best_checkpoint",
    "point_best",
    "readable_problem",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestError",
    "VerifyResult",
    "algo_name",
    "atomic_write_text",
    "collect_rank_hashes",
    "commit",
    "crash_point",
    "final_dir",
    "hash_files",
    "hash_own_files",
    "list_checkpoints",
    "newest_verified",
    "prepare_staging",
    "prune",
    "publish_rank_hashes",
    "read_manifest",
    "staging_dir",
    "step_of",
    "verified_split",
    "verify",
]
