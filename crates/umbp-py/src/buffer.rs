//! The buffer protocol through the C API itself: `PyObject_GetBuffer` and `PyBuffer_Release`, which
//! every CPython 3 exports, with the `Py_buffer` layout CPython documents (unchanged since 3.3).
//! PyO3 offers buffers to an abi3 build only from 3.11; declaring the two calls here keeps the
//! wheel at CPython >= 3.9.

use std::ffi::{c_char, c_int, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::InvalidInputError;

/// CPython's `Py_buffer`.
#[repr(C)]
struct RawView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: isize,
    itemsize: isize,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut isize,
    strides: *mut isize,
    suboffsets: *mut isize,
    internal: *mut c_void,
}

/// `PyBUF_SIMPLE`: a contiguous buffer of bytes.
const PYBUF_SIMPLE: c_int = 0;
/// `PyBUF_WRITABLE`.
const PYBUF_WRITABLE: c_int = 0x0001;

// SAFETY: these are CPython's own declarations (Include/cpython/object.h, abstract.h).
unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawView);
}

/// A contiguous view of a Python object's memory, held (the exporter may not resize or free it)
/// until dropped; dropping releases it, which needs the GIL: drop it only while attached.
pub(crate) struct View {
    raw: Box<RawView>,
}

impl View {
    /// A view of `obj`'s bytes, writable when `writable`; `InvalidInputError` when `obj` exports no
    /// contiguous buffer (or no writable one).
    pub(crate) fn new(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        let mut raw = Box::new(RawView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        let flags = if writable { PYBUF_SIMPLE | PYBUF_WRITABLE } else { PYBUF_SIMPLE };
        // SAFETY: `obj` is a live object (we hold the GIL through its `Bound`) and `raw` a valid,
        // zeroed Py_buffer that outlives the call.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py());
            let what = if writable { "a writable contiguous buffer" } else { "a contiguous buffer" };
            let err = InvalidInputError::new_err(format!(
                "{} does not export {what} (bytes, bytearray, memoryview, numpy arrays do)",
                obj.get_type().name().map_or_else(|_| "the object".to_owned(), |n| n.to_string())
            ));
            if let Some(cause) = cause {
                err.set_cause(obj.py(), Some(cause));
            }
            return Err(err);
        }
        Ok(Self { raw })
    }

    /// The first byte's address.
    pub(crate) fn ptr(&self) -> usize {
        self.raw.buf as usize
    }

    /// The length in bytes.
    pub(crate) fn len(&self) -> usize {
        usize::try_from(self.raw.len).unwrap_or(0)
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released once; the
        // owner drops it with the GIL held (see the type's contract).
        unsafe { PyBuffer_Release(&mut *self.raw) };
    }
}
