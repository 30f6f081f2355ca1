"""Alembic's environment and revision scripts for the coordinator's schema; driven by gpuswarm.coordinator.migrate."""
