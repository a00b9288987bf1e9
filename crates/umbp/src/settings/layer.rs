//! File → environment → flags, done once over one tree.
//!
//! The file is read into a TOML table whose flat keys of earlier files are moved to their
//! component's path ([`table::TABLE`](super::table::TABLE)); each `UMBP_*` variable and each flag
//! that is set writes its value at its row's path, in the file's syntax; the tree then
//! deserializes into [`Settings`], whose tables are the components' own configs. Every value is
//! checked where it enters, by deserializing a tree holding only that value, so an error names the
//! key, the variable or the flag that was wrong.
//!
//! Why not `figment`: it layers providers the same way, but its environment provider maps names
//! by prefix and nesting, while ours keeps the reference's variable names (`UMBP_NODE_ADDRESS` for
//! `node.listen`) and units (`UMBP_HEARTBEAT_TTL_SEC` in whole seconds, `*_MS` in milliseconds),
//! and its errors name the path, not the variable or flag the operator wrote. The table plus this
//! module is about the size of the glue figment would need.

use std::path::{Path, PathBuf};

use toml::{Table, Value};

use super::table::{self, EnvKind, Row, Scope, TABLE};
use super::tree::Settings;
use super::{EnvGetter, SettingsError};

/// The configuration file, read and checked, with its flat keys moved to their component's path.
#[derive(Clone, Default)]
pub struct FileConfig {
    tree: Table,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for FileConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = self.tree.clone();
        if let Some(token) = shown.get_mut("cluster_token") {
            *token = Value::String("<redacted>".into());
        }
        f.debug_struct("FileConfig").field("tree", &shown).finish()
    }
}

impl FileConfig {
    /// Parses the text of a configuration file; `origin` names it in errors. Every key is checked
    /// here: an unknown key or a bad value is an error naming it.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, SettingsError> {
        let bad = |message: String| SettingsError::BadFile { path: origin.to_owned(), message };
        let raw: Table = toml::from_str(text).map_err(|e| bad(e.to_string().trim().to_owned()))?;
        let mut tree = Table::new();
        let mut leaves = Vec::new();
        flatten(&raw, "", &mut leaves);
        for (key, value) in leaves {
            let row = table::by_key(&key).ok_or_else(|| bad(format!("unknown key `{key}`")))?;
            check(row.path, &value).map_err(|reason| bad(format!("{key}: {reason}")))?;
            if get(&tree, row.path).is_some() {
                return Err(bad(format!("{key}: set twice (it is also {})", row.path)));
            }
            set(&mut tree, row.path, value);
        }
        Ok(Self { tree })
    }

    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::ReadFile { path: path.to_owned(), source })?;
        Self::parse(&text, path)
    }

    /// The file named by `flag`, else by `UMBP_CONFIG`; no file gives every key unset.
    pub fn discover(flag: Option<&Path>, env: EnvGetter<'_>) -> Result<Self, SettingsError> {
        match flag.map(Path::to_owned).or_else(|| env("UMBP_CONFIG").filter(|p| !p.is_empty()).map(PathBuf::from)) {
            Some(path) => Self::load(&path),
            None => Ok(Self::default()),
        }
    }

    /// The settings the file alone gives (every key it does not set at its default).
    pub fn settings(&self) -> Result<Settings, SettingsError> {
        into_settings(self.tree.clone())
    }
}

/// A flag that was given: its name (`--ssd-capacity`) and its value in the file's syntax.
pub(crate) type FlagValue = (&'static str, Value);

/// The file, then the variables of the rows of `scopes`, then `flags` (of those rows).
pub(crate) fn layer(
    file: &FileConfig,
    env: EnvGetter<'_>,
    scopes: &[Scope],
    flags: &[FlagValue],
) -> Result<Settings, SettingsError> {
    let mut tree = file.tree.clone();
    for row in TABLE.iter().filter(|r| scopes.contains(&r.scope)) {
        // The first variable of a row wins: apply them last to first.
        for &(var, kind) in row.env.iter().rev() {
            // An empty name or address is unset; an empty number is a mistake.
            let Some(text) = env(var).filter(|t| kind != EnvKind::Text || !t.trim().is_empty()) else { continue };
            let value = from_env(&text, kind)
                .and_then(|v| check(row.path, &v).map(|()| v))
                .map_err(|reason| SettingsError::BadEnv { var, value: text.clone(), reason })?;
            set(&mut tree, row.path, value);
        }
    }
    for (flag, value) in flags {
        let row: &Row = table::by_flag(scopes, flag)
            .ok_or_else(|| SettingsError::Invalid { setting: flag, reason: "no such setting".into() })?;
        check(row.path, value).map_err(|reason| SettingsError::Invalid { setting: row.flag, reason })?;
        set(&mut tree, row.path, value.clone());
    }
    into_settings(tree)
}

fn into_settings(tree: Table) -> Result<Settings, SettingsError> {
    // Every value was checked on its way in; a failure here is a bug of the table.
    Value::Table(tree)
        .try_into()
        .map_err(|e: toml::de::Error| SettingsError::Invalid { setting: "settings", reason: e.to_string() })
}

/// Whether `value` at `path` deserializes: the component's own rules, on a tree of that one value.
fn check(path: &str, value: &Value) -> Result<(), String> {
    let mut one = Table::new();
    set(&mut one, path, value.clone());
    Value::Table(one).try_into::<Settings>().map(drop).map_err(|e| {
        // The caller names the key, variable or flag as the operator wrote it; drop toml's own
        // "in `path`" line.
        let text = e.to_string();
        text.split("\nin `").next().unwrap_or(&text).trim().to_owned()
    })
}

/// A variable's text as a value of the tree.
fn from_env(text: &str, kind: EnvKind) -> Result<Value, String> {
    let text = text.trim();
    let whole = |min: u64| match text.parse::<u64>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("expected a whole number >= {min}")),
    };
    Ok(match kind {
        EnvKind::Text => Value::String(text.to_owned()),
        EnvKind::Int => Value::Integer(text.parse::<i64>().map_err(|_| "expected a whole number".to_owned())?),
        EnvKind::Float => Value::Float(text.parse::<f64>().map_err(|_| "expected a number".to_owned())?),
        EnvKind::Bool => Value::Boolean(match text.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => return Err("expected true or false".into()),
        }),
        EnvKind::List => {
            let items: Vec<Value> =
                text.split(',').map(str::trim).filter(|d| !d.is_empty()).map(|d| Value::String(d.into())).collect();
            if items.is_empty() {
                return Err("expected a comma-separated list".into());
            }
            Value::Array(items)
        }
        EnvKind::Secs(min) => Value::String(format!("{}s", whole(min)?)),
        EnvKind::Millis(min) => Value::String(format!("{}ms", whole(min)?)),
    })
}

/// Every leaf of `table` as (dotted key, value); arrays are leaves.
fn flatten(table: &Table, prefix: &str, out: &mut Vec<(String, Value)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            Value::Table(t) if table::by_key(&key).is_none() => flatten(t, &key, out),
            other => out.push((key, other.clone())),
        }
    }
}

/// The value at a dotted `path`.
pub(crate) fn get<'a>(tree: &'a Table, path: &str) -> Option<&'a Value> {
    let (parents, leaf) = path.rsplit_once('.').map_or(("", path), |(p, l)| (p, l));
    let mut t = tree;
    for part in parents.split('.').filter(|p| !p.is_empty()) {
        t = t.get(part)?.as_table()?;
    }
    t.get(leaf)
}

/// Writes `value` at a dotted `path`, making the tables on the way.
fn set(tree: &mut Table, path: &str, value: Value) {
    let (parents, leaf) = path.rsplit_once('.').map_or(("", path), |(p, l)| (p, l));
    let mut t = tree;
    for part in parents.split('.').filter(|p| !p.is_empty()) {
        let entry = t.entry(part.to_owned()).or_insert_with(|| Value::Table(Table::new()));
        if !entry.is_table() {
            *entry = Value::Table(Table::new());
        }
        let Value::Table(next) = entry else { return };
        t = next;
    }
    t.insert(leaf.to_owned(), value);
}
