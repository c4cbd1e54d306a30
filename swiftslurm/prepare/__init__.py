"""Every check of a spec file before anything is sent: ``prepare(spec_path) -> Prepared`` (plan, scripts, notes).

The one first step of ``validate``, ``plan``, ``render``, ``submit`` and ``preflight``, and the library's: a Python
caller gets exactly the checks the command line runs. The CLI only parses arguments and prints the result.
"""

from .job import Prepared, prepare, scan_data

__all__ = ["Prepared", "prepare", "scan_data"]
