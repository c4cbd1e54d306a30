#!/bin/bash
# Re-capture `scontrol show hostnames` for every form in forms.txt into scontrol.txt
# (one block per form: "== FORM" then the host names, one a line). Needs scontrol on PATH
# (it expands hostlists without a controller).
cd "$(dirname "$0")"
{
  echo "# scontrol show hostnames, $(scontrol --version)"
  while IFS= read -r form; do
    echo "== $form"
    scontrol show hostnames "$form"
  done < forms.txt
} > scontrol.txt
