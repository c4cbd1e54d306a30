"""The checks that run on the nodes, one module each: ports (nc), allreduce (NCCL/gloo busbw), iperf
(iperf3), local (fio NVMe IOPS, GPUs, disk), topology (GPU interconnect, IB/RoCE)."""
