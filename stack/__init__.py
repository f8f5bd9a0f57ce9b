"""What starts Trainyard's parts together, above the three packages it joins: the server's commands
(`trainyard api|scheduler|worker|up|db|user|host`, cli.py), the embedded stack (`trainyard up`,
embedded.py) and the demo (demo.py). It imports `service`, `workers` and the `trainyard` client;
none of them imports it (tests/unit/test_boundaries.py)."""
