"""The results store: confirmed searches recorded under a fingerprint of what they
measured. It only stores, as Optuna's storages do: it hands a search the exact match's
record, a near match's recorded winners and calibration, as data, and keeps the result;
tuning/remembered.py runs the check on read and the seeding, outputs/store_notes.py and
outputs/store_listing.py say what it did and what it holds.

fingerprint.py  what a record is keyed by (exact and near)
record.py       one record: a summary with its date, versions and calibration
db.py           the store: SQLite by default, PostgreSQL for a team (SQLAlchemy)
session.py      what a search asks of the store (called from tuning/remembered.py)
"""
