"""Slurm, the one door: commands (sbatch/squeue/sacct/scontrol/scancel) and their parsers, the sbatch
template (``render``) and the pure SLURM_* -> ranks derivation (``distenv``).

May import: ``errors``, ``quoting``, ``spec``, ``plan`` (render only). Nothing else in swiftslurm runs a
Slurm command; ``from swiftslurm import slurm`` gives the commands below.
"""

from .commands import (
    SLURM_TIMEOUT_S,
    have_slurm,
    show_hostnames,
    requeue,
    ACTIVE_STATES,
    FINAL_STATES,
    normalize_state,
    is_final,
    parse_sbatch_parsable,
    expand_job_ids,
    SACCT_FIELDS,
    JobRecord,
    parse_sacct,
    SQUEUE_FORMAT,
    parse_squeue,
    merge_records,
    sbatch,
    refusal,
    job_records,
    scancel,
    parse_exc_node_list,
    parse_req_node_list,
    required_among,
    merge_exclude,
    exclude_and_requeue,
)

__all__ = [
    'SLURM_TIMEOUT_S',
    'have_slurm',
    'show_hostnames',
    'requeue',
    'ACTIVE_STATES',
    'FINAL_STATES',
    'normalize_state',
    'is_final',
    'parse_sbatch_parsable',
    'expand_job_ids',
    'SACCT_FIELDS',
    'JobRecord',
    'parse_sacct',
    'SQUEUE_FORMAT',
    'parse_squeue',
    'merge_records',
    'sbatch',
    'refusal',
    'job_records',
    'scancel',
    'parse_exc_node_list',
    'parse_req_node_list',
    'required_among',
    'merge_exclude',
    'exclude_and_requeue',
]
