"""Where a training step's time goes, in any process that trains through DeepSpeed (issue 19's "other half").

Put this directory on PYTHONPATH and set PHASE_PROBE_OUT=FILE.jsonl: when ``deepspeed.runtime.engine`` is
imported, DeepSpeedEngine's forward, backward and step are wrapped. Each call records its host time
(perf_counter) and its GPU time (CUDA events on the current stream, read in batches, so no sync is added to
the step); the gap from one step's end to the next step's forward is the trainer loop (data, callbacks,
logging). Rank 0 writes one JSON row per step. PHASE_PROBE_PROFILE=A:B also runs torch.profiler over steps
A..B-1 and writes FILE.prof.txt (top ops by CUDA and by CPU time). Used by packing_e2e.py --probe; it changes
nothing else in the process (PHASE_PROBE_SYNCS=A:B lists the host syncs of steps A..B-1: ``_SyncTrace``), except
with PHASE_PROBE_STEP_SYNC=1: a device sync after every optimizer step, the baseline arm for the host syncs
swiftslurm took out of the step (what a per-step ``.item()`` costs).
"""

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time

_OUT = os.environ.get("PHASE_PROBE_OUT")
_STEP_SYNC = os.environ.get("PHASE_PROBE_STEP_SYNC") == "1"
_PHASES = ("forward", "backward", "step")
# labelled for the profiler's tables only (a record_function range each; nothing is timed by the probe itself)
_LABELS = {
    "deepspeed.runtime.zero.stage_1_and_2": {"DeepSpeedZeroOptimizer": [
        "step", "scaled_global_norm", "_optimizer_step", "unscale_and_clip_grads", "free_grad_in_param_list",
        "_update_model_bit16_weights", "check_overflow", "reduce_ipg_grads", "reduce_ready_partitions_and_remove_grads",
        "average_tensor", "zero_grad", "backward", "_release_preflattened_grad_buffers"], None: ["all_gather_dp_groups"]},
    "transformers.trainer": {"Trainer": ["_maybe_log_save_evaluate", "get_batch_samples", "training_step", "log",
                                         "compute_loss"]},
    "deepspeed.runtime.engine": {"DeepSpeedEngine": ["_take_model_step", "allreduce_gradients", "zero_grad"]},
}


class _SyncTrace:
    """PHASE_PROBE_SYNCS=A:B: over steps A..B-1, torch's sync debug mode reports every operation that makes the
    host wait for the GPU (``.item()``, ``nonzero``, a blocking copy, ...); each report's call site outside torch is
    counted and written to FILE.syncs.txt (sites and counts per step: what holds a small model's host back)."""

    def __init__(self, out: str, spec: str) -> None:
        self.out, self.range = out + ".syncs.txt", tuple(int(x) for x in spec.split(":"))
        self.sites: dict[str, int] = {}
        self.on = False
        self.previous = None

    def at_step(self, step: int) -> None:
        import warnings

        import torch

        if not torch.cuda.is_available():
            return
        if step == self.range[0] and not self.on:
            self.on, self.previous = True, warnings.showwarning
            warnings.simplefilter("always")
            warnings.showwarning = self.seen
            torch.cuda.set_sync_debug_mode("warn")
        elif step == self.range[1] and self.on:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, self.on = self.previous, False
            steps = self.range[1] - self.range[0]
            with open(self.out, "w") as fh:
                fh.write(f"host syncs over steps {self.range[0]}..{self.range[1] - 1} (count per step, call site)\n")
                for site, n in sorted(self.sites.items(), key=lambda kv: -kv[1]):
                    fh.write(f"{n / steps:8.1f}  {site}\n")

    def seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        import traceback

        if "synchronizing" not in str(message):
            return (self.previous or (lambda *a, **k: None))(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "sitecustomize" not in f.filename
                  and "/warnings.py" not in f.filename]
        site = " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
        self.sites[site] = self.sites.get(site, 0) + 1
        return None


class _Probe:
    def __init__(self, out: str) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.step = -1
        self.cur: dict | None = None
        self.last_end_host: float | None = None
        self.last_end_event = None
        self.prof = None
        spec = os.environ.get("PHASE_PROBE_PROFILE", "")
        self.prof_range = tuple(int(x) for x in spec.split(":")) if spec else None
        self.depth = 0
        syncs = os.environ.get("PHASE_PROBE_SYNCS", "")
        self.syncs = _SyncTrace(out, syncs) if syncs else None

    def begin(self, phase: str):
        import torch

        if self.depth:
            self.depth += 1
            return None
        self.depth = 1
        now = time.perf_counter()
        if phase == "forward" and (self.cur is None or "step" in self.cur or "forward" in self.cur):
            if self.cur is not None:
                self.rows.append(self.cur)
            self.step += 1
            self.cur = {"i": self.step, "gap_host": None if self.last_end_host is None else now - self.last_end_host,
                        "_prev_end": self.last_end_event}
            if self.prof_range and self.step == self.prof_range[0]:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
                self.prof.__enter__()
            if self.syncs is not None:
                self.syncs.at_step(self.step)
            if len(self.rows) >= 10:
                self.flush()
        ev = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else None
        if ev is not None:
            ev.record()
        rf = torch.profiler.record_function(f"probe:{phase}")
        rf.__enter__()
        return (phase, now, ev, rf)

    def end(self, token) -> None:
        import torch

        self.depth -= 1
        if token is None:
            return
        phase, t0, ev0, rf = token
        rf.__exit__(None, None, None)
        ev1 = torch.cuda.Event(enable_timing=True) if ev0 is not None else None
        if ev1 is not None:
            ev1.record()
        if phase == "step" and _STEP_SYNC and ev1 is not None:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.cur is None:
            return
        self.cur[phase] = (now - t0, ev0, ev1)
        self.last_end_host, self.last_end_event = now, ev1
        if phase == "step" and self.prof is not None and self.prof_range and self.step == self.prof_range[1] - 1:
            self.prof.__exit__(None, None, None)
            with open(self.out + ".prof.txt", "w") as fh:
                ka = self.prof.key_averages()
                fh.write(f"steps {self.prof_range[0]}..{self.prof_range[1] - 1}\n")
                fh.write(ka.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=70) + "\n")
                fh.write(ka.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=70) + "\n")
                fh.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n")
            self.prof = None

    def flush(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with open(self.out, "a") as fh:
            for r in self.rows:
                row = {"i": r["i"], "gap_host_ms": None if r["gap_host"] is None else round(r["gap_host"] * 1e3, 2)}
                prev = r.get("_prev_end")
                for p in _PHASES:
                    if p not in r:
                        continue
                    host, e0, e1 = r[p]
                    row[f"{p}_host_ms"] = round(host * 1e3, 2)
                    if e0 is not None:
                        row[f"{p}_gpu_ms"] = round(e0.elapsed_time(e1), 2)
                        if prev is not None:  # GPU time between the previous phase's end and this one's start
                            row[f"{p}_gpu_gap_ms"] = round(prev.elapsed_time(e0), 2)
                        prev = e1
                fh.write(json.dumps(row) + "\n")
        self.rows.clear()


def _install() -> None:
    probe = _Probe(_OUT)

    def wrap(cls, name):
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def timed(self, *args, **kwargs):
            token = probe.begin(name)
            try:
                return fn(self, *args, **kwargs)
            finally:
                probe.end(token)

        setattr(cls, name, timed)

    def label(owner, name, qual):
        fn = getattr(owner, name, None)
        if fn is None or not os.environ.get("PHASE_PROBE_PROFILE"):
            return

        @functools.wraps(fn)  # inspect.getsource still finds DeepSpeed's own code (train/overflow.py reads it)
        def labelled(*args, **kwargs):
            import torch

            with torch.profiler.record_function(qual):
                return fn(*args, **kwargs)

        setattr(owner, name, labelled)

    pending = set(_LABELS) | {"deepspeed.runtime.engine"}

    class Finder(importlib.abc.MetaPathFinder):
        busy = False

        def find_spec(self, fullname, path, target=None):
            if fullname not in pending or self.busy:
                return None
            pending.discard(fullname)
            self.busy = True
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                self.busy = False
            loader_exec = spec.loader.exec_module

            def exec_module(module):
                loader_exec(module)
                for cls_name, names in _LABELS.get(fullname, {}).items():
                    owner = module if cls_name is None else getattr(module, cls_name)
                    for name in names:
                        label(owner, name, f"{cls_name or fullname.rsplit('.', 1)[-1]}.{name}")
                if fullname == "deepspeed.runtime.engine":
                    for name in _PHASES:
                        wrap(module.DeepSpeedEngine, name)
                    import atexit

                    atexit.register(lambda: (probe.rows.append(probe.cur) if probe.cur else None, probe.flush()))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if _OUT and os.environ.get("RANK", "0") == "0":
    _install()

if os.environ.get("PHASE_PROBE_ARM"):  # packing_e2e's arm with a sitecustomize of its own (dsnorm/, syncs/) under the probe
    import runpy

    runpy.run_path(os.environ["PHASE_PROBE_ARM"])
