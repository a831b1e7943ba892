"""The error registry (``stage_runtime/errors.py``): docs/errors.md's table says what the classes say, a wire type
has one owner and one status and outcome, and the lookups the frontends use follow the classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stage_runtime import errors
from stage_runtime.errors import DiffStageError, InvalidRequestError, RequestFailedError
from stage_runtime.serve.metrics import OUTCOMES
from stage_runtime.serve.wire import error_message, error_type_of, exception_from_message, status_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
HEADER = "| class | `error_type` | HTTP | outcome |"
Row = tuple[str | None, int | None, str | None]


def _cell(row: str, cell: str, number: bool = False) -> str | int | None:
    if cell == "—":
        return None
    if number and re.fullmatch(r"\d{3}", cell):
        return int(cell)
    if not number and re.fullmatch(r"`[a-z_]+`", cell):
        return cell[1:-1]
    raise AssertionError(f"docs/errors.md, row {row}: {cell!r} is not {'a status' if number else '`a_name`'} or —")


def doc_table(text: str) -> dict[str, Row]:
    """Class name → (error_type, HTTP status, outcome) as the table under HEADER gives them."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER)), None)
    assert start is not None, f"docs/errors.md has no table starting {HEADER!r}"
    rows: dict[str, Row] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = cells[0].strip("`")
        assert name not in rows, f"docs/errors.md lists {name} twice"
        rows[name] = (_cell(name, cells[1]), _cell(name, cells[2], number=True), _cell(name, cells[3]))
    return rows


def registry_table() -> dict[str, Row]:
    return {cls.__name__: (cls.error_type, cls.http_status, cls.outcome) for cls in errors.registry()}


def differences(doc: dict[str, Row], code: dict[str, Row]) -> list[str]:
    out = [f"{name} is missing from docs/errors.md" for name in code if name not in doc]
    out += [f"{name} is in docs/errors.md but not in stage_runtime/errors.py" for name in doc if name not in code]
    for name in code.keys() & doc.keys():
        for what, in_code, in_doc in zip(("error_type", "HTTP status", "outcome"), code[name], doc[name], strict=True):
            if in_code != in_doc:
                out.append(f"{name}: {what} is {in_code!r} in the code, {in_doc!r} in docs/errors.md")
    return sorted(out)


def test_docs_errors_md_gives_every_class_its_type_status_and_outcome():
    assert differences(doc_table(DOC.read_text()), registry_table()) == []


def test_a_missing_or_different_row_is_named():
    text = DOC.read_text()
    text = re.sub(r"^\| `QueueFullError` .*\n", "", text, flags=re.M)
    text = text.replace("| `RequestAbortedError` | `request_aborted` | 409 | `aborted` |",
                        "| `RequestAbortedError` | `request_aborted` | 503 | `aborted` |")
    text = text.replace("| `EngineDeadError` | `engine_dead` | 503 | `dead` |",
                        "| `EngineDeadError` | `engine_died` | 503 | — |")
    assert differences(doc_table(text), registry_table()) == [
        "EngineDeadError: error_type is 'engine_dead' in the code, 'engine_died' in docs/errors.md",
        "EngineDeadError: outcome is 'dead' in the code, None in docs/errors.md",
        "QueueFullError is missing from docs/errors.md",
        "RequestAbortedError: HTTP status is 409 in the code, 503 in docs/errors.md"]
    with pytest.raises(AssertionError, match=r"row RpcError: '500 \(ZMQ\)' is not a status or —"):
        doc_table(text.replace("| `RpcError` | `rpc_error` | 500 |", "| `RpcError` | `rpc_error` | 500 (ZMQ) |"))


def test_the_registry_is_the_whole_tree_root_first():
    def tree(cls: type) -> set[type]:
        return {cls}.union(*(tree(sub) for sub in cls.__subclasses__() if sub.__module__ == errors.__name__))

    assert errors.registry()[0] is DiffStageError and set(errors.registry()) == tree(DiffStageError)
    assert all(errors.by_name(cls.__name__) is cls for cls in errors.registry())
    assert errors.by_name("ValueError") is None and errors.by_type("no_such_type") is None


def test_a_wire_type_has_one_owner_and_one_status_and_outcome():
    for error_type in {cls.error_type for cls in errors.registry()} - {None}:
        carriers = [cls for cls in errors.registry() if cls.error_type == error_type]
        assert errors.by_type(error_type) is carriers[0]
        assert {(cls.http_status, cls.outcome) for cls in carriers} == {(carriers[0].http_status, carriers[0].outcome)}
    assert errors.by_type("invalid_request_error") is InvalidRequestError      # ConfigError borrows its type


def test_every_outcome_is_a_label_of_the_requests_counter():
    assert {cls.outcome for cls in errors.registry()} - {None} <= set(OUTCOMES)
    assert errors.outcome_of(None) == "completed" and errors.outcome_of("no_such_type") == "failed"
    assert errors.outcome_of("rpc_error") == "failed"                           # a type without an outcome
    assert errors.outcome_of("queue_full") == "rejected"


@pytest.mark.parametrize("cls", [c for c in errors.registry() if c.error_type is not None], ids=lambda c: c.__name__)
def test_the_wire_answers_each_class_as_the_registry_says(cls):
    exc = InvalidRequestError("n", 0, "bad") if cls is InvalidRequestError else (
        errors.RequestTooLargeError("body", "big") if cls.fields else cls("it broke"))
    message = error_message(exc, request_id="r")
    assert message["error_type"] == error_type_of(exc) == cls.error_type
    assert message["status_code"] == status_of(cls.error_type) == (cls.http_status or 500)
    back = exception_from_message(message)
    owner = errors.by_type(cls.error_type)
    assert type(back) is (RequestFailedError if owner.fields and cls is not InvalidRequestError else owner)
    assert str(back) == str(exc)


def test_an_error_outside_the_tree_is_an_internal_error():
    assert error_type_of(KeyError("x")) == "internal_error" == error_type_of(errors.ModelLoadError("gone"))
    assert status_of("internal_error") == 500
    assert type(errors.from_wire(None, "lost")) is RequestFailedError
