"""On the PYTHONPATH of a Trainyard `script` job only: Python imports this at start-up in every
process of the job. It asks for Trainyard's Accelerate hooks once the script imports Accelerate
(see workers/script_hooks.py), so the script itself needs no change."""

import os

if os.environ.get("TRAINYARD_EVENTS_FILE"):
    from workers.script_hooks import install_on_import

    install_on_import()
