"""Saving and loading a converted module: a folder with the ONNX model and two JSON files.

``model.onnx`` (the converted model, weights inline; beside it ``model.onnx.data`` for
models over 2 GB), ``mixprec_torch.json`` (input names, output structure, dtype,
exporter) and ``report.json`` (the conversion report). Nothing in it is pickled: loading
runs no code and needs neither the original module nor its class.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.models import load_model, save_model, write_text
from mixprec.pipeline.report import NodeReport, Report

__all__ = ["read_saved", "save_converted"]

MODEL_FILE = "model.onnx"
SPEC_FILE = "mixprec_torch.json"
REPORT_FILE = "report.json"


def save_converted(
    path: str | os.PathLike[str], model: ir.Model, spec: Mapping[str, Any], report: Report
) -> None:
    """Write a converted module (its ONNX ``model``, its input/output ``spec`` as JSON
    data, its ``report``) to the folder ``path`` (created; files in it are replaced)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise MixprecError(f"{folder}: exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, folder / MODEL_FILE)
    write_text(folder / SPEC_FILE, json.dumps(dict(spec), indent=2) + "\n")
    write_text(folder / REPORT_FILE, report.to_json() + "\n")


def report_from_dict(data: Mapping[str, Any]) -> Report:
    """Rebuild a :class:`Report` from ``Report.to_dict()`` output."""
    names = {f.name for f in dataclasses.fields(Report)}
    fields = {k: v for k, v in data.items() if k in names and k != "nodes"}
    nodes = [NodeReport(**n) for n in data.get("nodes", [])]
    return Report(nodes=nodes, **fields)


def read_saved(path: str | os.PathLike[str]) -> tuple[ir.Model, Report, dict[str, Any]]:
    """The model, the report and the spec's JSON data of a folder written by
    :func:`save_converted` (:func:`mixprec.torch.load` builds the module from them).

    Raises:
        MixprecError: the folder or one of its files is missing or malformed.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise MixprecError(f"{folder}: not a folder written by ConvertedModule.save()")
    try:
        spec_data = json.loads((folder / SPEC_FILE).read_text())
        report_data = json.loads((folder / REPORT_FILE).read_text())
    except FileNotFoundError as exc:
        raise MixprecError(f"{folder}: missing {Path(exc.filename).name}") from None
    except json.JSONDecodeError as exc:
        raise MixprecError(f"{folder}: malformed JSON ({exc})") from None
    try:
        report = report_from_dict(report_data)
    except TypeError as exc:
        raise MixprecError(f"{folder / REPORT_FILE}: malformed report ({exc})") from None
    return load_model(folder / MODEL_FILE), report, spec_data
