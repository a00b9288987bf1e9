//! The medium a Python node lends, chosen by name as `umbp node --medium` chooses it.
//!
//! Nothing here restates a medium's settings: the name is read by the command line's own
//! [`MediumKind::from_name`], and the settings (a Python dict whose keys are the settings file's
//! `[node.<medium>]` keys) are deserialized into the medium's own settings struct — `DramConfig`,
//! `HbmConfig`, `SsdSettings`, `CxlConfig`, `ObjectSettings` — with their defaults, units
//! (`"4GiB"`, `"3s"`) and unknown-key errors. Added here: the capacity argument, the few Python
//! keyword names for required settings (`ssd_dirs`, `cxl_path`, `object_url`, `object_endpoint`,
//! the command line's flag names), and errors that name those arguments.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use umbp::MediumKind;
use umbp_peer::pool_client::Medium;

use crate::errors::config_error;

/// Keyword names of settings a medium requires: (Python name, medium, settings key).
const NAMED: [(&str, MediumKind, &str); 4] = [
    ("ssd_dirs", MediumKind::Ssd, "dirs"),
    ("cxl_path", MediumKind::Cxl, "path"),
    ("object_url", MediumKind::Object, "url"),
    ("object_endpoint", MediumKind::Object, "endpoint"),
];

/// The Python name of the setting `key` of `kind` (its keyword when it has one).
fn python_name(kind: MediumKind, key: &str) -> &str {
    NAMED.iter().find(|(_, k, f)| *k == kind && *f == key).map_or(key, |(n, _, _)| n)
}

/// What a node asks for: the medium's name, the bytes it lends (and the argument's name, for
/// errors), the node's page size, DRAM's `prefault`, and the medium's settings.
pub(crate) struct MediumRequest<'a, 'py> {
    pub(crate) name: &'a str,
    pub(crate) capacity: u64,
    pub(crate) capacity_arg: &'static str,
    pub(crate) page_size: u64,
    pub(crate) prefault: bool,
    pub(crate) settings: Option<&'a Bound<'py, PyDict>>,
}

/// Builds the medium of `req`, or a `ConfigError` (an `InvalidInputError` and a `ValueError`)
/// naming the argument to fix: an unknown medium, a missing required setting, a setting of another
/// medium, an unknown key, a value of the wrong type, a capacity below one page.
pub(crate) fn build(py: Python<'_>, req: &MediumRequest<'_, '_>) -> PyResult<Medium> {
    let kind = MediumKind::from_name(req.name).map_err(|e| config_error(py, format!("medium: {e}")))?;
    let medium = kind.as_str();
    let table = settings_table(py, kind, req)?;
    if kind == MediumKind::None {
        if req.capacity > 0 {
            return Err(config_error(
                py,
                format!("medium 'none' lends nothing: leave {} at 0 or name a medium", req.capacity_arg),
            ));
        }
        if let Some(key) = table.keys().next() {
            return Err(config_error(py, format!("medium 'none' takes no settings ({key} given)")));
        }
        return Ok(Medium::None);
    }
    if req.capacity < req.page_size {
        return Err(config_error(
            py,
            format!(
                "medium {medium:?}: {} = {} is smaller than one page ({} bytes)",
                req.capacity_arg, req.capacity, req.page_size
            ),
        ));
    }
    let de = |e: toml::de::Error| config_error(py, format!("medium {medium:?}: {}", e.message()));
    let value = toml::Value::Table(table);
    let missing = |key: &str, what: &str| {
        config_error(py, format!("medium {medium:?} needs {} ({what})", python_name(kind, key)))
    };
    let invalid = |e: &dyn std::fmt::Display| config_error(py, format!("medium {medium:?}: {e}"));
    Ok(match kind {
        MediumKind::Dram => Medium::Dram(value.try_into().map_err(de)?),
        MediumKind::Hbm => Medium::Hbm(value.try_into().map_err(de)?),
        MediumKind::Ssd => {
            let s: umbp_peer::pool_client::SsdConfig = value.try_into().map_err(de)?;
            if s.dirs.is_empty() {
                return Err(missing("dirs", "a list of directories, one per drive"));
            }
            s.check_value_pages().map_err(|e| invalid(&e))?;
            Medium::Ssd(s)
        }
        MediumKind::Cxl => {
            let c: umbp_peer::pool_client::CxlConfig = value.try_into().map_err(de)?;
            if c.path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                return Err(missing("path", "a /dev/daxX.Y device, a file on a DAX filesystem, or a file standing in"));
            }
            Medium::Cxl(c)
        }
        MediumKind::Object => {
            let o: umbp_peer::pool_client::ObjectSettings = value.try_into().map_err(de)?;
            if o.url.as_ref().is_none_or(String::is_empty) {
                return Err(missing("url", "s3://bucket/prefix or file:///dir"));
            }
            // The medium's own rules (URL, endpoint, sizes); credentials are read when it starts.
            o.check(req.page_size).map_err(|e| invalid(&e))?;
            Medium::Object(o)
        }
        MediumKind::None => Medium::None,
    })
}

/// The settings of `req` as the settings file's table of the medium: keyword names mapped to their
/// keys (refused for another medium, or given twice), `None` values left out (the default), the
/// capacity added (refused among the settings: it is its own argument), and DRAM's `prefault`
/// (unless the settings give it).
fn settings_table(py: Python<'_>, kind: MediumKind, req: &MediumRequest<'_, '_>) -> PyResult<toml::Table> {
    let mut table = toml::Table::new();
    let mut given_as: Vec<(String, String)> = Vec::new();
    for (k, v) in req.settings.map(|d| d.iter()).into_iter().flatten() {
        let name: String = k.extract().map_err(|_| config_error(py, "medium settings: keys must be str"))?;
        if v.is_none() {
            continue;
        }
        let key = match NAMED.iter().find(|(n, _, _)| *n == name) {
            Some((_, owner, _)) if *owner != kind => {
                return Err(config_error(
                    py,
                    format!("{name} is a setting of medium {:?}, not {:?}", owner.as_str(), kind.as_str()),
                ));
            }
            Some((_, _, key)) => (*key).to_owned(),
            None => name.clone(),
        };
        if key == "capacity_bytes" {
            return Err(config_error(
                py,
                format!("the medium's capacity is the {} argument, not a medium setting", req.capacity_arg),
            ));
        }
        if let Some((_, first)) = given_as.iter().find(|(k, _)| *k == key) {
            return Err(config_error(py, format!("medium setting {key} given twice ({first} and {name})")));
        }
        let value = to_toml(py, &v, &name)?;
        // A drive list of one may be given as the directory itself.
        let value = match value {
            toml::Value::String(s) if kind == MediumKind::Ssd && key == "dirs" => {
                toml::Value::Array(vec![toml::Value::String(s)])
            }
            v => v,
        };
        table.insert(key.clone(), value);
        given_as.push((key, name));
    }
    if kind != MediumKind::None {
        let capacity = i64::try_from(req.capacity)
            .map_err(|_| config_error(py, format!("{} = {} is too large", req.capacity_arg, req.capacity)))?;
        table.insert("capacity_bytes".into(), toml::Value::Integer(capacity));
    }
    // Only DRAM is touched at start-up; other media ignore the flag (mori's config sets it for a
    // node that lends nothing).
    if kind == MediumKind::Dram {
        table.entry("prefault").or_insert(toml::Value::Boolean(req.prefault));
    }
    Ok(table)
}

/// A Python setting value as a TOML value: bool, int, float, str, a path (`os.PathLike`), or a
/// list or tuple of them.
fn to_toml(py: Python<'_>, v: &Bound<'_, PyAny>, name: &str) -> PyResult<toml::Value> {
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(toml::Value::Boolean(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        let i: i64 =
            v.extract().map_err(|_| config_error(py, format!("medium setting {name}: {v} is out of range")))?;
        return Ok(toml::Value::Integer(i));
    }
    if let Ok(f) = v.cast::<PyFloat>() {
        return Ok(toml::Value::Float(f.value()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(toml::Value::String(s.to_cow()?.into_owned()));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items = v.try_iter()?.map(|item| to_toml(py, &item?, name)).collect::<PyResult<Vec<_>>>()?;
        return Ok(toml::Value::Array(items));
    }
    if v.hasattr("__fspath__")? {
        let path = v.call_method0("__fspath__")?;
        if let Ok(s) = path.cast::<PyString>() {
            return Ok(toml::Value::String(s.to_cow()?.into_owned()));
        }
    }
    let type_name = v.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    Err(config_error(
        py,
        format!("medium setting {name}: a {type_name} is not a bool, int, float, str, path or list of them"),
    ))
}
