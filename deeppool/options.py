"""Command-line options declared once, on the fields of the config dataclasses (as torchtitan's config tree).

A field that is an option says so in its metadata (:func:`option`): its help, and its flag where that is
not ``--`` and the field's name. A field holding another config (:func:`nested`) adds that config's options,
with a prefix where one config class serves twice (the background's ``--bg-lr`` is
:class:`~deeppool.executor.config.OptimizerConfig`'s ``--lr``). From that one declaration come:

* a command's parameters (:func:`expand`): typer's ``Annotated[T, typer.Option(flag, help=...)]``, put into
  the command's ``inspect.Signature`` where a placeholder parameter names a :class:`Group`; the command
  receives each group's values as :class:`Given` and builds its config (:meth:`Given.build`);
* the flags that give a config back (:func:`argv`: a command printed to resume, or run on other machines);
* the JSON round trip of a config tree (:func:`to_json`, :func:`from_json`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, TypeVar

from deeppool.errors import DeeppoolError

_FLAG, _NEST = "deeppool.flag", "deeppool.nest"
CommandT = TypeVar("CommandT", bound=Callable[..., Any])


@dataclass(frozen=True)
class Default:
    """A command-line default that differs from the field's: ``value`` (None: decided by the command) and what
    ``--help`` shows for it."""

    value: Any
    shown: bool | str = True


@dataclass(frozen=True, kw_only=True)
class Flag:
    help: str
    name: str | None = None
    """``--flag``; None: ``--`` and the field's name with dashes."""
    shown: bool | str = True
    """What ``--help`` shows as the default (True: the value)."""
    default: Default | None = None


@dataclass(frozen=True, kw_only=True)
class Nest:
    prefix: str = ""
    """Put after the ``--`` of every flag of the nested config (``bg-``: ``--lr`` is ``--bg-lr``)."""
    help_prefix: str = ""
    only: tuple[str, ...] | None = None
    """The nested config's fields that are options here (None: all that are options)."""
    defaults: Mapping[str, Default] = dataclasses.field(default_factory=dict)
    """Command-line defaults by field name, where they differ here from the field's own."""


def option(default: Any = MISSING, *, help: str, flag: str | None = None, shown: bool | str = True,
           command_default: Default | None = None, default_factory: Any = MISSING) -> Any:
    """A config field that is a command-line option."""
    metadata = {_FLAG: Flag(help=help, name=flag, shown=shown, default=command_default)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def nested(*, default: Any = MISSING, default_factory: Any = MISSING, prefix: str = "", help_prefix: str = "",
           only: tuple[str, ...] | None = None, defaults: Mapping[str, Default] | None = None) -> Any:
    """A config field holding another config, whose options are this one's too."""
    nest = Nest(prefix=prefix, help_prefix=help_prefix, only=only, defaults=dict(defaults or {}))
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_NEST: nest})


@dataclass(frozen=True)
class Group:
    """A config class whose options a command takes: ``optional`` (built only when its required options are
    given, which are then not required), ``only`` some of its top-level fields."""

    kind: type
    optional: bool = False
    only: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Option:
    """One command-line option: the field it sets (``path``, dotted from the group's config), its parameter."""

    path: str
    param: str
    flag: str
    annotation: Any
    default: Any
    help: str
    shown: bool | str

    def parameter(self) -> inspect.Parameter:
        import typer

        info = typer.Option(self.flag, help=self.help, show_default=self.shown)
        default = inspect.Parameter.empty if self.default is ... else self.default
        return inspect.Parameter(self.param, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=typing.Annotated[self.annotation, info])


def _group(kind: Group | type) -> Group:
    return kind if isinstance(kind, Group) else Group(kind)


@functools.cache
def options(group: Group | type) -> tuple[Option, ...]:
    """The options of ``group``'s config tree, in field order."""
    group = _group(group)
    return tuple(_walk(group.kind, prefix="", path="", help_prefix="", only=group.only, defaults={},
                       optional=group.optional))


def _walk(kind: type, *, prefix: str, path: str, help_prefix: str, only: tuple[str, ...] | None,
          defaults: Mapping[str, Default], optional: bool) -> list[Option]:
    hints = typing.get_type_hints(kind)
    found = []
    for field in dataclasses.fields(kind):
        if only is not None and field.name not in only:
            continue
        flag, nest = field.metadata.get(_FLAG), field.metadata.get(_NEST)
        if nest is not None:
            inner, maybe = _config_type(hints[field.name])
            found += _walk(inner, prefix=prefix + nest.prefix, path=f"{path}{field.name}.",
                           help_prefix=help_prefix + nest.help_prefix, only=nest.only, defaults=nest.defaults,
                           optional=maybe)
        elif flag is not None:
            found.append(_option(field, flag, hints[field.name], prefix=prefix, path=path + field.name,
                                 help_prefix=help_prefix, default=defaults.get(field.name, flag.default),
                                 optional=optional))
    return found


def _option(field: dataclasses.Field[Any], flag: Flag, annotation: Any, *, prefix: str, path: str,
            help_prefix: str, default: Default | None, optional: bool) -> Option:
    name = "--" + prefix + (flag.name or "--" + field.name.replace("_", "-"))[2:]
    shown = flag.shown
    if default is not None:
        value, shown = default.value, default.shown
    elif field.default is not MISSING:
        value = field.default
    elif field.default_factory is not MISSING:
        value = field.default_factory()
    elif optional:
        value = None  # the required field of a config that is built only when it is given
    else:
        value = ...  # required on the command line too
    if value is None and not _allows_none(annotation):
        annotation = annotation | None
    return Option(path=path, param=name[2:].replace("-", "_"), flag=name, annotation=annotation, default=value,
                  help=help_prefix + flag.help, shown=shown)


def _allows_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _config_type(annotation: Any) -> tuple[type, bool]:
    """The config class of a nested field, and whether the field may be None."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0], True
    return annotation, False


@dataclass(frozen=True)
class Given:
    """What a command was given for one group's options: values by field path (``"optimizer.lr"``)."""

    group: Group
    values: Mapping[str, Any]

    @classmethod
    def defaults(cls, group: Group | type) -> Given:
        """The values a command gets when no option is given."""
        group = _group(group)
        return cls(group, {option.path: option.default for option in options(group)})

    def __getitem__(self, path: str) -> Any:
        return self.values[path]

    @property
    def present(self) -> bool:
        """The config's required fields were given (always, for a group that is not optional)."""
        return all(self.values.get(path) is not None for path in _required(self.group.kind, ""))

    def build(self, resolved: Mapping[str, Any] | None = None) -> Any:
        """The config, from the given values and ``resolved`` ones (by path: what the command decided, where
        an option's default is decided by the command, or a field that is not an option); validated as it is
        constructed."""
        return _build(self.group.kind, {**self.values, **(resolved or {})}, "")


def _required(kind: type, path: str) -> list[str]:
    return [path + field.name for field in dataclasses.fields(kind)
            if field.init and field.default is MISSING and field.default_factory is MISSING]


def _build(kind: type, values: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(kind)
    given: dict[str, Any] = {}
    for field in dataclasses.fields(kind):
        where = path + field.name
        if where in values:
            given[field.name] = values[where]
        elif _NEST in field.metadata and any(key.startswith(where + ".") for key in values):
            inner, optional = _config_type(hints[field.name])
            if optional and any(values.get(required) is None for required in _required(inner, where + ".")):
                continue  # not given: the field's default (None)
            given[field.name] = _build(inner, values, where + ".")
    return kind(**given)


def expand(**groups: Group | type) -> Callable[[CommandT], CommandT]:
    """Decorate a command: each keyword-only parameter named in ``groups`` is replaced, where it stands, by
    that group's options, and receives their values as a :class:`Given`.

    The command's other parameters stay as written; every parameter after the first is keyword-only, so the
    command can be called from Python too (``run(plan, out=Path("o"))``), with the options' defaults.
    """
    def decorate(command: CommandT) -> CommandT:
        written = inspect.signature(command, eval_str=True)
        parameters, sources = [], {}
        for index, parameter in enumerate(written.parameters.values()):
            if parameter.name in groups:
                for option in options(groups[parameter.name]):
                    parameters.append(option.parameter())
                    sources[option.param] = (parameter.name, option.path)
            else:
                kind = parameter.kind if index == 0 else inspect.Parameter.KEYWORD_ONLY
                parameters.append(parameter.replace(kind=kind))
        public = written.replace(parameters=parameters)  # refuses two parameters of one name

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = public.bind(*args, **kwargs)
            bound.apply_defaults()
            call: dict[str, Any] = {name: {} for name in groups}
            for name, value in bound.arguments.items():
                if name in sources:
                    placeholder, path = sources[name]
                    call[placeholder][path] = value
                else:
                    call[name] = value
            for name, kind in groups.items():
                call[name] = Given(_group(kind), call[name])
            return command(**call)

        run.__signature__ = public  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters if p.annotation is not p.empty}
        return typing.cast(CommandT, run)

    return decorate


def argv(group: Group | type, config: Any) -> list[str]:
    """The command-line options that give ``config`` (None, False and unset options left out)."""
    found: list[str] = []
    for option in options(group):
        value = _value_at(config, option.path)
        if value is None or value is False:
            continue
        if value is True:
            found.append(option.flag)
            continue
        text = value.value if isinstance(value, enum.Enum) else repr(value) if isinstance(value, float) else str(value)
        found += [option.flag, text]
    return found


def _value_at(config: Any, path: str) -> Any:
    for name in path.split("."):
        if config is None:
            return None
        config = getattr(config, name)
    return config


def to_json(config: Any) -> dict[str, Any]:
    """A config tree as JSON: enums by value, paths as strings, tuples as lists."""
    return {field.name: _encoded(getattr(config, field.name)) for field in dataclasses.fields(config) if field.init}


def _encoded(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_encoded(item) for item in value]
    return value


ConfigT = TypeVar("ConfigT")


def from_json(kind: type[ConfigT], data: Mapping[str, Any], *, where: str = "config") -> ConfigT:
    """The config of :func:`to_json`'s form; a field left out takes its default, an unknown one is refused."""
    if not isinstance(data, Mapping):
        raise DeeppoolError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(kind)
    names = {field.name for field in dataclasses.fields(kind) if field.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DeeppoolError(f"{where}: unknown field '{unknown[0]}' of {kind.__name__}")
    try:
        return kind(**{name: _decoded(hints[name], value, f"{where}.{name}") for name, value in data.items()})
    except (TypeError, ValueError) as err:
        raise DeeppoolError(f"{where}: {err}") from None


def _decoded(annotation: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _decoded(next(arg for arg in args if arg is not type(None)), value, where)
    if typing.get_origin(annotation) is tuple:
        return tuple(_decoded(args[0], item, where) for item in value)
    if dataclasses.is_dataclass(annotation):
        return from_json(annotation, value, where=where)
    if isinstance(annotation, type) and issubclass(annotation, (enum.Enum, Path)):
        return annotation(value)
    if annotation is float:
        return float(value)
    return value
