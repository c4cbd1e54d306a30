"""sbatch script rendering (stub: the submitter work replaces this)."""


def render_sbatch(plan) -> str:
    return "#!/bin/bash\n# TODO\n"
