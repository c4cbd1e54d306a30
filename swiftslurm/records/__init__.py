"""The records a job leaves in its task dir, one module a record: its fields, its read (tolerant: a missing, damaged
or foreign file is no record) and its write. Writers (``node``, ``train``) and readers (``watch``, ``doctor``,
``jobs``, ``cli``) both import them from here, so no reader imports the code that writes; the file names are
``taskdir``'s.

- ``requeues``: ``requeues.json``, one record a walltime stop;
- ``restarts``: ``restarts.json``, one record an in-job restart decision;
- ``failures``: ``logs/failure-rank-<r>.json``, why a rank gave up;
- ``chains``: ``chain.json``, the jobs of a singleton chain.
"""
