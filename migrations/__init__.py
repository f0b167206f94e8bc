"""Alembic environment for spectune's own tables (see migrations/env.py and api/schema.py)."""
