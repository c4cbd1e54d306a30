"""doctor's rules, one module per kind of evidence, each pure over a ``TaskRun``: logs (``logrules``), metrics
(``metricrules``), Slurm, preflight and requeue records (``jobrules``), in-job restarts (``restartrules``), stragglers
(``slowrules``) and hangs (``hang``); ``doctor/diagnose.py`` lists them in order.
"""
