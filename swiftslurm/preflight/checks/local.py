"""Node-local checks: ``nvme`` (fio 4k random reads), ``gpu`` (nvidia-smi), ``disk`` (free space).

Each returns results for one node; a missing tool or path is a failed result with a hint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...fsutil import DIRECTORY, path_kind
from .. import bounded
from ..results import CheckResult, missing_tool, which

FIO_RUNTIME_S = 3
FIO_SIZE = "64M"


# ------------------------------------------------------------------ nvme


def direct_io_supported(directory: str) -> tuple[bool, str]:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs and some FUSE cannot)."""
    probe = Path(directory) / f".swiftslurm-odirect-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        os.close(fd)
        return True, ""
    except OSError as exc:
        return False, exc.strerror or str(exc)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def parse_fio_json(text: str) -> tuple[float | None, str]:
    """(read IOPS, error) from ``fio --output-format=json`` (pure)."""
    start = text.find("{")  # fio may print notes before the JSON
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        data = None
    if not data or not data.get("jobs"):
        return None, f"no fio JSON: {text.strip()[:160]!r}"
    job = data["jobs"][0]
    if job.get("error"):
        return None, f"fio job error {job['error']}"
    return float(job["read"]["iops"]), ""


def nvme_target(ds_config: dict | None, output_dir: str) -> tuple[str, str]:
    """(directory, why) the nvme check tests when preflight.nvme_path is unset (pure): the NVMe offload path of
    the DeepSpeed config (what ZeRO-Infinity swaps to), else the checkpoint directory (what every save writes)."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme" and section.get("nvme_path"):
            return str(section["nvme_path"]), f"the DeepSpeed {key} nvme_path"
    return output_dir, "the checkpoint dir"


def check_nvme(node: str, path: str, min_iops: int, timeout_s: float = FIO_RUNTIME_S + 60, binding: bool = True) -> list[CheckResult]:
    """fio 4k random reads in ``path``; a miss of a floor that is not ``binding`` (the default one) only warns."""
    expected = f">= {min_iops} IOPS (4k random read)" + ("" if binding else " (default floor: warns only)")
    if which("fio") is None:
        return [missing_tool("nvme", node, "fio")]
    kind = path_kind(path)
    if kind != DIRECTORY:
        return [CheckResult("nvme", node, False, f"nvme_path {path} is not a directory on {node} ({kind})", expected,
                            "set preflight.nvme_path to a directory on the local NVMe (e.g. /local/scratch)")]
    direct, why = direct_io_supported(path)
    target = Path(path) / f".swiftslurm-fio-{node}-{os.getpid()}"
    argv = [
        "fio", "--name=swiftslurm-preflight", f"--filename={target}", f"--size={FIO_SIZE}", "--rw=randread", "--bs=4k",
        "--ioengine=libaio", "--iodepth=32", f"--direct={int(direct)}", f"--runtime={FIO_RUNTIME_S}", "--time_based",
        "--output-format=json",
    ]
    try:
        proc = bounded.run(argv, timeout_s)
        if proc.timed_out:
            iops, err = None, proc.describe_timeout("fio", timeout_s)
        else:
            iops, err = parse_fio_json(proc.stdout)
            if iops is None and proc.stderr.strip():
                err += f" ({proc.stderr.strip()[:160]})"
    finally:
        try:
            target.unlink()
        except OSError:
            pass
    if iops is None:
        return [CheckResult("nvme", node, False, f"fio failed on {path}: {err}", expected,
                            "run the fio command by hand on this node; is the filesystem full or read-only?")]
    mode = "direct I/O" if direct else f"BUFFERED, O_DIRECT not supported here ({why}): page-cache speed, not the disk's"
    ok = iops >= min_iops
    hint = "" if ok else (f"{path} on {node} is slower than expected: is it really the local NVMe? check `nvme smart-log`; "
                          + ("or lower preflight.min_nvme_iops" if binding else "set preflight.nvme_path to the local NVMe, or preflight.min_nvme_iops"))
    return [CheckResult("nvme", node, ok, f"{iops:,.0f} IOPS on {path} ({mode})", expected, hint, {"iops": round(iops), "direct": direct},
                        warn_only=not ok and not binding)]


# ------------------------------------------------------------------ gpu

NVSMI_QUERY = "index,name,memory.total,memory.used,ecc.errors.uncorrected.volatile.total,uuid"
GPU_ENV = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")  # the job's GPUs on this node, most specific first


def job_gpu_ids(env: dict[str, str]) -> list[str] | None:
    """The GPU indices or UUIDs this job was given on this node, None where nothing says (pure)."""
    for name in GPU_ENV:
        value = (env.get(name) or "").strip()
        if value and value not in ("NoDevFiles", "void"):
            return [v.strip() for v in value.split(",") if v.strip()]
    return None


def own_gpus(gpus: list[dict], ids: list[str] | None) -> list[dict]:
    """The rows of nvidia-smi that are this job's GPUs (pure). Matched by index or UUID; where none match but the
    counts agree (cgroups show only the job's GPUs, renumbered), all rows are."""
    if ids is None:
        return gpus
    mine = [g for g in gpus if g["index"] in ids or g.get("uuid") in ids]
    if not mine and len(gpus) == len(ids):
        return gpus
    return mine


def parse_nvidia_smi(text: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=NVSMI_QUERY --format=csv,noheader,nounits`` (pure)."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        ecc = parts[4]
        gpus.append({
            "index": parts[0], "name": parts[1],
            "memory_total_mib": int(parts[2]) if parts[2].isdigit() else None,
            "memory_used_mib": int(parts[3]) if parts[3].isdigit() else None,
            "ecc_uncorrected": int(ecc) if ecc.isdigit() else 0,
            "uuid": parts[5] if len(parts) > 5 else "",
        })
    return gpus


def judge_gpus(node: str, gpus: list[dict], gpus_per_node: int) -> list[CheckResult]:
    """Count, memory and health of the GPUs nvidia-smi listed (pure)."""
    expected = f"{gpus_per_node} healthy GPU(s)"
    if len(gpus) < gpus_per_node:
        return [CheckResult("gpu", node, False, f"{len(gpus)} GPU(s) visible", expected,
                            "a GPU is missing or fell off the bus: check `nvidia-smi` and dmesg (Xid errors); drain the node")]
    sick = [g for g in gpus if g["ecc_uncorrected"] > 0]
    if sick:
        names = ", ".join(f"GPU {g['index']} ({g['ecc_uncorrected']} uncorrected ECC)" for g in sick)
        return [CheckResult("gpu", node, False, names, expected, "uncorrected ECC errors: reset the GPU or drain the node")]
    busy = [g for g in gpus if g["memory_total_mib"] and g["memory_used_mib"] and g["memory_used_mib"] > 0.1 * g["memory_total_mib"]]
    mem = gpus[0]["memory_total_mib"] if gpus else 0
    observed = f"{len(gpus)} x {gpus[0]['name']} ({mem} MiB)" if gpus else "no GPUs"
    if busy:
        return [CheckResult("gpu", node, False, observed + f"; GPU {busy[0]['index']} already uses {busy[0]['memory_used_mib']} MiB", expected,
                            "another process holds GPU memory: `nvidia-smi` shows which")]
    return [CheckResult("gpu", node, True, observed, expected)]


def check_gpu(node: str, gpus_per_node: int, timeout_s: float = 30, env: dict[str, str] | None = None) -> list[CheckResult]:
    """nvidia-smi on this node, judged over the job's own GPUs only (``env``: where Slurm names them)."""
    if gpus_per_node == 0:
        return [CheckResult("gpu", node, True, "no GPUs expected (slurm.gpus_per_node = 0)", "none")]
    if which("nvidia-smi") is None:
        return [missing_tool("gpu", node, "nvidia-smi")]
    proc = bounded.run(["nvidia-smi", f"--query-gpu={NVSMI_QUERY}", "--format=csv,noheader,nounits"], timeout_s)
    if proc.timed_out:
        return [CheckResult("gpu", node, False, proc.describe_timeout("nvidia-smi", timeout_s), f"{gpus_per_node} GPU(s)",
                            "a hung nvidia-smi usually means a GPU fault (Xid in dmesg): drain the node")]
    if proc.returncode != 0:
        return [CheckResult("gpu", node, False, f"nvidia-smi failed: {(proc.stderr or proc.stdout).strip()[:160]}", f"{gpus_per_node} GPU(s)",
                            "is the driver loaded? check `nvidia-smi` on this node")]
    return judge_gpus(node, own_gpus(parse_nvidia_smi(proc.stdout), job_gpu_ids(dict(os.environ) if env is None else env)), gpus_per_node)


# ------------------------------------------------------------------ disk


def check_disk(node: str, output_dir: str, min_free_gb: float) -> list[CheckResult]:
    expected = f">= {min_free_gb:g} GB free"
    probe = Path(output_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free_gb = shutil.disk_usage(probe).free / 1e9
    except OSError as exc:
        return [CheckResult("disk", node, False, f"cannot stat {output_dir}: {exc.strerror}", expected, "check the output_dir path")]
    ok = free_gb >= min_free_gb
    hint = "" if ok else "free space in output_dir (checkpoints are large), or point job.output_dir elsewhere"
    return [CheckResult("disk", node, ok, f"{free_gb:,.1f} GB free in {output_dir}", expected, hint, {"free_gb": round(free_gb, 2)})]


# ------------------------------------------------------------------ sharedfs


def read_nonce(node: str, path: Path, nonce: str) -> list[CheckResult]:
    """The ``sharedfs`` check on one node: the file rank 0 wrote is visible here with the same nonce."""
    expected = "the file rank 0 wrote, same content"
    try:
        seen = path.read_text().strip()
    except OSError as exc:
        return [CheckResult("sharedfs", node, False, f"{path} not visible ({exc.strerror})", expected,
                            "job.output_dir must be on a filesystem shared by all nodes (NFS/Lustre/GPFS), not node-local")]
    if seen != nonce:
        return [CheckResult("sharedfs", node, False, f"{path} holds another nonce", expected,
                            "this node sees a different directory under the same path: put output_dir on the shared filesystem")]
    return [CheckResult("sharedfs", node, True, f"sees {path.parent}", expected)]
