"""Revision scripts, one per schema change; write them with scripts/new-migration, never by hand from nothing."""
