"""The results store: confirmed searches recorded under a fingerprint of what they
measured, so the same setup is answered from the record (checked by running its winner
and baseline once more) and a similar one starts from its winners.

fingerprint.py  what a record is keyed by (exact and near)
record.py       one record: a summary with its date, versions and calibration
db.py           the store: SQLite by default, PostgreSQL for a team (SQLAlchemy)
reconfirm.py    the check on read: each figure within its recorded interval
session.py      what a search asks of the store (called from tuning/run.py)
listing.py      `autotune results`: list, export, import
"""
