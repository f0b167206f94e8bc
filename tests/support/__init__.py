"""What tests share, beside the fixtures (those stay in tests/conftest.py).

api_client.py   `Api` (a TestClient with a token per role), tokens and settings for an app
cluster.py      a real API process with real worker processes on the simulated engine
db.py           fresh Postgres and SQLite databases cloned from a migrated template
helpers.py      processes (spawn, servers, the simulated engine), bounded waits, free ports
search.py       driving a study's search through the API with simulated measurements
source_walk.py  reading the source by AST: imports, import cycles, who writes a study's life
specs.py        study specs and a worker inventory to start from
"""
