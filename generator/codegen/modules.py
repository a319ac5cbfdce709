"""Module structs: the parameters one call of a user's function makes, as one C++ struct.

A user's function that the model calls more than once, each call with its own `name=`
(ResNet's `basic_block(x, ..., name='layer1_0')`), makes the same parameters in every
call under that name (`layer1_0_conv1_weight`, `layer1_0_bn1_running_mean`, ...): a
module, as PyTorch's `layer1[0]` is. The generated Network holds each call's parameters
as one member of a struct type named after the function (`BasicBlock layer1_0`), its
fields the parameters without the call's name (`layer1_0.conv1_weight`); calls whose
fields differ (a block with a shortcut branch and one without) are struct types of their
own (`BasicBlockWithShortcut`). A parameter's state_dict name stays what it was: only
its C++ member path changes (`paths`). The fields' shapes differ between the calls
(64 or 128 channels): a struct's constructor takes each list of sizes that differs as
one argument.

Their gradients are one struct per call likewise (`BasicBlockGradients d_layer1_0`, fields
`d_layer1_0.conv1_weight`) when every trainable field has one and the name is free
(`use_gradient_structs`, at lowering's training part).

Decided from the graph, before lowering: every stage after it prints a parameter by
its path. A function whose calls do not all follow the pattern (a parameter without
the call's name, two calls of one name, a name something else in the model has) keeps
its parameters as they are.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field

# A printed field of a module: layer1_0.conv1_weight.ptr(), layer1_0.conv1_weight.size(), ... + _at
_FIELD = re.compile(r"^(\w+)\.(\w+)\.((?:ptr|size)\(\).*)$")


@dataclass
class ModuleField:
    name: str  # conv1_weight
    trainable: bool
    shape: list  # per dimension: an int, or Arg: the constructor argument giving it


@dataclass(frozen=True)
class Arg:
    index: int


@dataclass
class ModuleInstance:
    name: str  # layer1_0
    type: str  # BasicBlock
    call_id: int  # the call of the user's function (Loc.call_id)
    params: list  # the parameters' names, in the model's order
    sizes: list  # the constructor's arguments


@dataclass
class ModuleStruct:
    type: str  # BasicBlock
    function: str  # basic_block
    source: str  # the file of the user's function (resnet18.py)
    fields: list  # [ModuleField]
    arity: int  # constructor arguments
    instances: list = field(default_factory=list)  # [ModuleInstance]
    arg_names: list = field(default_factory=list)  # the constructor's argument names (named when printed)
    gradients: bool = False  # its calls' gradients are one struct too (`d_layer1_0`, `BasicBlockGradients`)

    @property
    def gradient_type(self) -> str:
        return f"{self.type}Gradients"

    def declaration(self, tensor: str) -> str:
        return _declaration(self, tensor)

    def gradients_declaration(self, field_type: str, unset: str) -> str:
        return gradients_declaration(self, field_type, unset)


@dataclass
class Modules:
    structs: list = field(default_factory=list)  # [ModuleStruct], in order of first use
    paths: dict = field(default_factory=dict)  # parameter name -> C++ path (layer1_0.conv1_weight)

    def path(self, name: str) -> str:
        return self.paths.get(name, name)

    def gradient_path(self, name: str) -> str | None:
        """Parameter `name`'s gradient as a field of its module's gradient struct
        (`d_layer1_0.conv1_weight`), when its module's gradients are one; else None."""
        found = self.instance_of(name)
        if found is None or not self.struct_of(found[0]).gradients:
            return None
        return f"d_{found[0].name}.{found[1]}"

    def use_gradient_structs(self, grads: set, free) -> None:
        """Make each struct's gradients one struct per call (`BasicBlockGradients d_layer1_0`)
        when every trainable field of every call has a gradient (`grads`: the parameters that
        have) and each `d_<call>` name is free (`free(name)`)."""
        for struct in self.structs:
            trainable = [p for i in struct.instances for p, f in zip(i.params, _fields_in_order(struct, i))
                         if f.trainable]
            names = [f"d_{i.name}" for i in struct.instances]
            struct.gradients = bool(trainable) and all(p in grads for p in trainable) and all(map(free, names))

    def gradient_declaration(self, param: str) -> str:
        """The Network's member holding the gradients of `param`'s module, at the module's first
        trainable parameter (`BasicBlockGradients d_layer1_0{/*C=*/64};`); else ""."""
        found = self.instance_of(param)
        if found is None:
            return ""
        inst, member = found
        struct = self.struct_of(inst)
        first = next(f.name for f in struct.fields if f.trainable)
        if not struct.gradients or member != first:
            return ""
        args = ", ".join(f"/*{n}=*/{v}" for n, v in zip(struct.arg_names, inst.sizes))
        return f"{struct.gradient_type} d_{inst.name}{{{args}}};"

    def instance_of(self, name: str):
        """(the instance, its field name) holding parameter `name`, or None."""
        path = self.paths.get(name)
        if path is None:
            return None
        owner, member = path.split(".", 1)
        inst = next(i for s in self.structs for i in s.instances if i.name == owner)
        return inst, member

    def struct_of(self, inst: ModuleInstance) -> ModuleStruct:
        return next(s for s in self.structs if s.type == inst.type)

    def declaration(self, inst: ModuleInstance) -> str:
        """`BasicBlock layer1_0{/*C=*/64};`, the Network's member."""
        return instance_declaration(inst, self.struct_of(inst))

    def instances(self) -> list:
        return [i for s in self.structs for i in s.instances]

    def field_of_each(self, values):
        """(struct type, the module of each, field, the rest) when each of `values` (one per call
        of an outlined function) is the same field of a module, the modules of one struct type
        (`layer1_0.conv1_weight.ptr()`, `layer2_1.conv1_weight.ptr()`); else None."""
        found = [_FIELD.match(str(v)) for v in values]
        if not all(found):
            return None
        instances = {i.name: i for i in self.instances()}
        owners = [m.group(1) for m in found]
        fields = {m.group(2, 3) for m in found}
        types = {instances[o].type for o in owners if o in instances}
        if len(fields) != 1 or len(types) != 1 or not all(o in instances for o in owners):
            return None
        member, rest = fields.pop()
        return types.pop(), owners, member, rest


def gradient_field_of_each(modules: Modules, values):
    """(gradient struct type, the gradient struct of each, field) when each of `values` is the
    same field of a module's gradient struct (`d_layer1_0.conv1_weight`); else None."""
    found = [re.fullmatch(r"d_(\w+)\.(\w+)", str(v)) for v in values]
    if not all(found):
        return None
    instances = {i.name: i for i in modules.instances()}
    owners = [m.group(1) for m in found]
    fields = {m.group(2) for m in found}
    types = {instances[o].type for o in owners if o in instances}
    if len(fields) != 1 or len(types) != 1 or not all(o in instances for o in owners):
        return None
    struct = next(s for s in modules.structs if s.type in types)
    return struct.gradient_type, [f"d_{o}" for o in owners], fields.pop()


def local_name(owners) -> str:
    """A function's name for its calls' modules: what their names share, without the numbers
    (layer1_0, layer2_1 -> `layer`), else `module`."""
    common = owners[0]
    for o in owners[1:]:
        while not o.startswith(common):
            common = common[:-1]
    common = common.rstrip("_0123456789")
    return common if common.isidentifier() and not keyword.iskeyword(common) else "module"


def find_modules(graph, reserved=lambda name: False) -> Modules:
    """The module structs of `graph`'s parameters (see the module's docstring); `reserved`
    tells a name the C++ may not use (a keyword, a macro: ir/names.py's is_reserved)."""
    calls: dict = {}  # (file, function) -> {call_id: [param]}
    names: dict = {}  # call_id -> the call's name=
    for p in graph.params:
        loc = p.loc
        if loc is None or loc.call is None or not loc.call_text:
            continue
        function = loc.call_text.split("(", 1)[0]
        calls.setdefault((loc.filename, function), {}).setdefault(loc.call_id, []).append(p)
        names[loc.call_id] = dict(loc.call_args).get("name")
    taken = {p.name for p in graph.params} | {v.name for v in graph.values()} | {v.name for v in graph.inputs}
    taken |= {str(d) for d in graph.dims}
    out = Modules()
    used_types = set(_DEEPGEN_TYPES) | taken | {n for n in names.values() if isinstance(n, str)}
    for (filename, function), by_call in calls.items():
        instances = _instances_of(by_call, names, taken, reserved)
        if instances is None:
            continue
        variants: dict = {}  # fields -> [(call_id, name, params)]
        for call_id, name, params in instances:
            key = tuple((p.name[len(name) + 1:], p.kind == "param", len(p.shape)) for p in params)
            variants.setdefault(key, []).append((call_id, name, params))
        main = max(variants, key=lambda k: len(variants[k]))
        for key, members in variants.items():
            type_name = _type_name(function, key, main, used_types | {f[0] for f in key})
            used_types.add(type_name)
            struct = _struct(type_name, function, key, members)
            out.structs.append(struct)
            for inst in struct.instances:
                for p in inst.params:
                    out.paths[p] = f"{inst.name}.{p[len(inst.name) + 1:]}"
    order = {p.name: k for k, p in enumerate(graph.params)}
    out.structs.sort(key=lambda s: order[s.instances[0].params[0]])
    return out


# The types model.h declares beside the modules' in the model's namespace.
_DEEPGEN_TYPES = ("Model", "Network", "Inputs", "Outputs")


def _instances_of(by_call: dict, names: dict, taken: set, reserved):
    """[(call_id, name, params)] of a function's calls when each is a module, else None."""
    if len(by_call) < 2:
        return None
    out, seen = [], set()
    for call_id, params in by_call.items():
        name = names[call_id]
        if not (isinstance(name, str) and name.isidentifier()) or name in seen or name in taken or reserved(name):
            return None
        fields = [p.name[len(name) + 1:] for p in params]
        if not all(p.name.startswith(name + "_") for p in params) or not all(
                f.isidentifier() and not reserved(f) for f in fields):
            return None
        seen.add(name)
        out.append((call_id, name, params))
    return out


def _camel(snake: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in snake.split("_") if part)


def _type_name(function: str, key: tuple, main: tuple, used: set) -> str:
    """The main variant (most calls) is the function's name in CamelCase; another one
    says what it has that the main one lacks (`BasicBlockWithShortcut`), or lacks."""
    name = _camel(function) or "Module"
    if key != main:
        mine, theirs = [f[0] for f in key], {f[0] for f in main}
        extra = [f for f in mine if f not in theirs]
        missing = [f[0] for f in main if f[0] not in set(mine)]
        word = (extra or missing or ["variant"])[0].split("_")
        word = word[: next((k for k, w in enumerate(word) if w.isdigit()), len(word))] or word[:1]
        name += ("With" if extra else "Without") + _camel("_".join(word))
    base, k = name, 2
    base = base if base not in used else base + "Module"
    name = base
    while name in used:
        name, k = f"{base}{k}", k + 1
    return name


def _struct(type_name: str, function: str, key: tuple, members: list) -> ModuleStruct:
    """The struct of calls `members` (same fields): each dimension that differs between
    them is a constructor argument, one per distinct list of values."""
    columns: dict = {}  # the list of values across the calls -> argument index
    fields = []
    for k, (name, trainable, rank) in enumerate(key):
        shape = []
        for axis in range(rank):
            values = tuple(int(params[k].shape[axis]) for _, _, params in members)
            if len(set(values)) == 1:
                shape.append(values[0])
            else:
                shape.append(Arg(columns.setdefault(values, len(columns))))
        fields.append(ModuleField(name, trainable, shape))
    first = members[0][2][0]
    source = first.loc.short.split(":")[0] if first.loc else ""
    struct = ModuleStruct(type_name, function, source, fields, len(columns))
    for j, (call_id, name, params) in enumerate(members):
        sizes = [values[j] for values in columns]
        struct.instances.append(ModuleInstance(name, type_name, call_id, [p.name for p in params], sizes))
    struct.arg_names = [f"size{k}" for k in range(len(columns))]
    return struct


def name_arguments(struct: ModuleStruct, known: dict, call_args: dict) -> None:
    """Name the constructor's arguments: after a size of the function's C++ code that has
    the same value in every call (`known`: call_id -> {size name: its value}, `C`, `O`), else
    after an int argument of the user's function that does (`call_args`: call_id -> {name:
    value}, `channels`), else size0, size1, ..."""
    names = []
    for k in range(struct.arity):
        values = [str(i.sizes[k]) for i in struct.instances]
        found = None
        for table in (known, call_args):
            if not all(i.call_id in table for i in struct.instances):
                continue
            rows = [table[i.call_id] for i in struct.instances]
            same = [n for n in rows[0] if n.isidentifier() and n not in names
                    and all(str(r.get(n)) == v for r, v in zip(rows, values))]
            if same:
                found = same[0]
                break
        names.append(found or f"size{k}")
    struct.arg_names = names


def _dims(struct: ModuleStruct, f: ModuleField) -> str:
    return ", ".join(struct.arg_names[d.index] if isinstance(d, Arg) else str(d) for d in f.shape)


def _constructor(struct: ModuleStruct, type_name: str, inits: list) -> list:
    """`BasicBlock(std::int64_t C)` and its member initializer list, one member a line."""
    args = ", ".join(f"std::int64_t {n}" for n in struct.arg_names)
    lines = [f"  {'explicit ' if struct.arity == 1 else ''}{type_name}({args})"]
    for k, init in enumerate(inits):
        lines.append(f"      {':' if k == 0 else ' '} {init}{',' if k < len(inits) - 1 else ' {}'}")
    return lines + [""]


def _declaration(struct: ModuleStruct, tensor: str) -> str:
    """The struct's C++ declaration: its constructor (the shapes from its arguments) and its
    fields, the parameters first, then the running statistics (mutable)."""
    fields = [f for f in struct.fields if f.trainable] + [f for f in struct.fields if not f.trainable]
    calls = ", ".join(i.name for i in struct.instances)
    lines = [f"// The parameters of a call of {struct.function}() in {struct.source}: {calls}.",
             f"struct {struct.type} {{"]
    lines += _constructor(struct, struct.type,
                          [f"{f.name}{{std::vector<std::int64_t>{{{_dims(struct, f)}}}}}" for f in fields])
    for f in fields:
        if not f.trainable and (f is fields[0] or fields[fields.index(f) - 1].trainable):
            lines += ["", "  // Running statistics: forward() in training mode updates them (hence mutable)."]
        lines.append(f"  {'' if f.trainable else 'mutable '}{tensor} {f.name};  // [{_dims(struct, f)}]")
    lines.append("};")
    return "\n".join(lines)


def gradients_declaration(struct: ModuleStruct, field_type: str, unset: str) -> str:
    """The struct of a call's gradients: a field per trainable parameter, of `field_type`
    (dg::Slice<float>), each made with its shape and `unset` (nullptr: not placed yet)."""
    fields = [f for f in struct.fields if f.trainable]
    lines = [f"// The gradients of a {struct.type}'s parameters.", f"struct {struct.gradient_type} {{"]
    lines += _constructor(struct, struct.gradient_type,
                          [f"{f.name}{{std::vector<std::int64_t>{{{_dims(struct, f)}}}, {unset}}}" for f in fields])
    lines += [f"  {field_type} {f.name};  // [{_dims(struct, f)}]" for f in fields]
    lines.append("};")
    return "\n".join(lines)


def _fields_in_order(struct: ModuleStruct, inst: ModuleInstance) -> list:
    by_name = {f.name: f for f in struct.fields}
    return [by_name[p[len(inst.name) + 1:]] for p in inst.params]


def instance_declaration(inst: ModuleInstance, struct: ModuleStruct) -> str:
    args = ", ".join(f"/*{n}=*/{v}" for n, v in zip(struct.arg_names, inst.sizes))
    return f"{struct.type} {inst.name}{{{args}}};"
