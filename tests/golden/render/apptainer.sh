#!/bin/bash
# Written by swiftslurm VERSION from test.toml.
# Submit with plain `sbatch THIS_FILE`; it runs `swiftslurm run` on every rank (one Slurm task per rank).
#SBATCH --job-name=site
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=1
#SBATCH --gpus-per-node=4
#SBATCH --time=00:05:00
#SBATCH --partition=debug
#SBATCH --signal=USR2@30
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=/work/jobs/out/slurm-%j.out

# The plan every rank reads (written by `swiftslurm render -o FILE` / `swiftslurm submit`).
export SWIFTSLURM_PLAN=/work/jobs/out/swiftslurm-plan.json
if [ ! -r "$SWIFTSLURM_PLAN" ]; then
    echo "swiftslurm: plan file $SWIFTSLURM_PLAN is missing; write it with 'swiftslurm render SPEC -o FILE'" >&2
    exit 2
fi

# [env]: exported on every node (srun passes the environment to every rank).
export NCCL_DEBUG=INFO

# slurm.setup: your lines, verbatim, before the ranks start (what they export reaches every rank).
module load cuda/12.4

# container.env: these host values override the image's inside the container.
if [ -n "${HF_TOKEN+x}" ]; then export APPTAINERENV_HF_TOKEN="$HF_TOKEN"; fi

# Walltime: Slurm sends USR2 to every rank (--signal without B:); the runtime saves a verified
# checkpoint and rank 0 requeues the job. Should the batch shell get USR2 itself (scancel --batch
# --signal=USR2, or a site that signals the batch step), forward it to the srun step.
srun_pid=""
forward_usr2() {
    echo "swiftslurm: USR2 received by the batch shell; forwarding to the srun step" >&2
    if [ -n "$srun_pid" ]; then kill -USR2 "$srun_pid" 2>/dev/null || true; fi
}
trap forward_usr2 USR2

# srun of Slurm 22.05-23.02 does not inherit --cpus-per-task: without this each rank is bound to one CPU.
export SRUN_CPUS_PER_TASK=1

# Every rank runs inside the container: apptainer /work/jobs/images/pytorch.sif
srun --kill-on-bad-exit=1 --unbuffered apptainer exec --nv --bind /lustre/data:/data:ro --bind /scratch:/scratch --bind /work/jobs/out:/work/jobs/out --pwd /workspace --writable-tmpfs /work/jobs/images/pytorch.sif python3 -m swiftslurm run --plan /work/jobs/out/swiftslurm-plan.json &
srun_pid=$!
rc=0
wait "$srun_pid" || rc=$?
# `wait` returns early (status > 128) when a trapped signal arrives: keep waiting for srun itself.
while [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; do
    rc=0
    wait "$srun_pid" || rc=$?
done
exit "$rc"
