"""What runs on a rank: ``swiftslurm run`` (``runtime``), the walltime signal (``signals``), the start banner.

May import: ``plan``, ``slurm``, ``checkpoint``, ``preflight``, ``train`` and the base modules; never ``submit`` or ``cli``.
"""
