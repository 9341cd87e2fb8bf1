"""An executor whose arguments use the whole argument language: optional arguments with
and without defaults, enums, nested objects (with their own required properties), arrays
of scalars and of objects, a free-form object and an array of any elements."""

from __future__ import annotations

from pathlib import Path

RICH = """
name = "plan_trip"
version = "1.0.0"
description = "Plan a trip: legs, travellers and preferences"
runtime = "python"
entry = "main.py"

[args.title]
type = "string"
required = true
description = "A name for the trip"

[args.budget]
type = "number"
description = "The most to spend, in euros"

[args.nights]
type = "integer"
default = 3

[args.class]
type = "string"
enum = ["economy", "business"]
default = "economy"

[args.tags]
type = "array"
items = { type = "string", enum = ["beach", "city", "hiking"] }

[args.legs]
type = "array"
required = true
description = "The legs of the trip, in order"

[args.legs.items]
type = "object"

[args.legs.items.properties.from]
type = "string"
required = true

[args.legs.items.properties.to]
type = "string"
required = true

[args.legs.items.properties.by]
type = "string"
enum = ["train", "plane", "bus"]

[args.traveller]
type = "object"

[args.traveller.properties.name]
type = "string"
required = true

[args.traveller.properties.age]
type = "integer"
"""

#: The same executor, with the two constructs strict mode cannot express.
LOOSE = (
    RICH.replace('name = "plan_trip"', 'name = "plan_loose"')
    + """
[args.extra]
type = "object"
description = "Anything else, as any object"

[args.notes]
type = "array"
"""
)


def write_executor(root: Path, text: str = RICH, name: str = "plan_trip") -> Path:
    """`text` as the executor `name` under `root` (an executors folder); returns its
    manifest's path."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "main.py").write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    path = folder / "manifest.toml"
    path.write_text(text)
    return path
