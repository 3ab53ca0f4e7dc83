"""Set-based writes for the engine's hot path: one statement for many rows.

The ORM's bulk_update builds a CASE per field and row and bulk_create prepares each
object through the model layer; for the few tables a transition writes, a plain
executemany of one UPDATE or INSERT costs a fraction of that, and an UPDATE can carry a
compare-and-set per row. Values still go through each field's own preparation, so JSON,
UUIDs and datetimes are stored exactly as the ORM stores them.
"""

from __future__ import annotations

from django.db import connection
from django.db.models import Model


def rows_update(
    model: type[Model], rows: list, fields: list[str], *, status_in: tuple, match: str = ""
) -> int:
    """UPDATE each row's `fields` by primary key while its status is one of `status_in`
    (and its `match` field still has the value the row holds); returns the rows changed.

    One statement for all rows (executemany): a compare-and-set per row at the cost of a
    plain UPDATE, where the ORM's bulk_update would build a CASE per field and row.
    """
    if not rows:
        return 0
    meta, quote = model._meta, connection.ops.quote_name
    columns = [meta.get_field(name) for name in fields]
    sets = ", ".join(f"{quote(c.column)} = %s" for c in columns)
    where = f"{quote(meta.pk.column)} = %s AND {quote('status')} IN ({', '.join(['%s'] * len(status_in))})"
    guard = [meta.get_field(match)] if match else []
    if guard:
        where += f" AND {quote(guard[0].column)} = %s"
    params = [
        [c.get_db_prep_save(getattr(row, c.attname), connection) for c in columns]
        + [meta.pk.get_db_prep_value(row.pk, connection), *status_in]
        + [c.get_db_prep_value(getattr(row, c.attname), connection) for c in guard]
        for row in rows
    ]
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {where}", params)
        return cursor.rowcount


def rows_insert(model: type[Model], rows: list[Model], fields: list[str]) -> None:
    """INSERT the rows' `fields` (attribute names; a foreign key by its field name) in one
    statement. Primary keys are not read back: for rows nothing refers to afterwards."""
    if not rows:
        return
    meta, quote = model._meta, connection.ops.quote_name
    columns = [meta.get_field(name) for name in fields]
    names = ", ".join(quote(c.column) for c in columns)
    marks = ", ".join(["%s"] * len(columns))
    params = [[c.get_db_prep_save(getattr(row, c.attname), connection) for c in columns] for row in rows]
    with connection.cursor() as cursor:
        cursor.executemany(f"INSERT INTO {quote(meta.db_table)} ({names}) VALUES ({marks})", params)
