"""Set-based writes for the engine's hot path: one statement for many rows.

The ORM's bulk_update builds a CASE per field and row and bulk_create prepares each
object through the model layer; for the few tables a transition writes, a plain
executemany of one UPDATE or INSERT costs a fraction of that, and an UPDATE can carry a
compare-and-set per row. Values still go through each field's own preparation, so JSON,
UUIDs and datetimes are stored exactly as the ORM stores them.

Reads on that path (`rows_select`) likewise skip the ORM's per-query compilation and
build the same model instances from one prepared column list.
"""

from __future__ import annotations

import weakref
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
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
    return _execute(f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {where}", params)


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
    _execute(f"INSERT INTO {quote(meta.db_table)} ({names}) VALUES ({marks})", params)


def _execute(sql: str, params: list[list]) -> int:
    """One statement per parameter row; returns the rows changed. A single row goes as a
    plain execute: psycopg runs executemany in pipeline mode, whose set-up costs more than
    the round trip it saves when there is one row (most small batches' writes)."""
    with connection.cursor() as cursor:
        if len(params) == 1:
            cursor.execute(sql, params[0])
        else:
            cursor.executemany(sql, params)
        return cursor.rowcount


class _Select:
    """One model's columns and those of some of its foreign keys' rows, read as the ORM
    reads them: the statement's column list is built once per connection, and each
    column keeps the converters the ORM would apply to it."""

    def __init__(self, model: type[Model], related: tuple[str, ...], conn: BaseDatabaseWrapper) -> None:
        quote = conn.ops.quote_name
        self.model = model
        # (model, its alias, the foreign key it is reached by or None, its fields)
        self.parts: list[tuple[type[Model], str, Any, list]] = [
            (model, "t0", None, model._meta.concrete_fields)
        ]
        joins = []
        for n, name in enumerate(related, start=1):
            fk = model._meta.get_field(name)
            target = fk.related_model
            alias = f"t{n}"
            kind = "LEFT OUTER JOIN" if fk.null else "INNER JOIN"
            joins.append(
                f"{kind} {quote(target._meta.db_table)} {alias} ON {alias}.{quote(target._meta.pk.column)}"
                f" = t0.{quote(fk.column)}"
            )
            self.parts.append((target, alias, fk, target._meta.concrete_fields))
        columns = []
        self.converters: list[list] = []
        for _, alias, _, fields in self.parts:
            for f in fields:
                columns.append(f"{alias}.{quote(f.column)}")
                col = f.get_col(alias)
                self.converters.append(
                    [(c, col) for c in conn.ops.get_db_converters(col) + col.get_db_converters(conn)]
                )
        self.head = f"SELECT {', '.join(columns)} FROM {quote(model._meta.db_table)} t0 {' '.join(joins)}"

    def rows(self, conn: BaseDatabaseWrapper, column: str, values: list) -> list[Model]:
        field = self.model._meta.get_field(column)
        params = [field.get_db_prep_value(field.to_python(v), conn) for v in values]
        marks = ", ".join(["%s"] * len(params))
        sql = f"{self.head} WHERE t0.{conn.ops.quote_name(field.column)} IN ({marks})"
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            fetched = cursor.fetchall()
        found = []
        for raw in fetched:
            values_ = list(raw)
            for i, converters in enumerate(self.converters):
                for convert, col in converters:
                    values_[i] = convert(values_[i], col, conn)
            start, row = 0, None
            for model, _, fk, fields in self.parts:
                chunk = values_[start : start + len(fields)]
                start += len(fields)
                if fk is None:
                    row = model.from_db(conn.alias, None, chunk)
                else:  # a LEFT JOIN that found nothing reads as all NULLs: no related row
                    fk.set_cached_value(
                        row, None if chunk[0] is None else model.from_db(conn.alias, None, chunk)
                    )
            found.append(row)
        return found


_selects: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rows_select(model: type[Model], column: str, values, *, related: tuple[str, ...] = ()) -> list[Model]:
    """The rows whose `column` is one of `values`, each with its `related` foreign keys'
    rows attached as select_related attaches them; in no particular order.

    The same instances the ORM would build, without its per-query compilation (about a
    fifth of the draining worker's profile at small batches): the engine reads its rows
    this way on the hot path.
    """
    values = list(values)
    if not values:
        return []
    conn = connections[DEFAULT_DB_ALIAS]
    cache = _selects.setdefault(conn, {})
    select = cache.get((model, related))
    if select is None:
        select = cache[(model, related)] = _Select(model, related, conn)
    return select.rows(conn, column, values)
