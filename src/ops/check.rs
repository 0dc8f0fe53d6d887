//! Validation helpers: every op checks its tensors and scalars through these, so every refusal
//! reads the same way and names the tensor or scalar, what was expected and what was given.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::tensor::Scalars;

/// Metadata keys that tools write into safetensors headers on their own; never an op's scalar.
const IGNORED_METADATA: &[&str] = &["format"];

/// Shape checks over the named input tensors of one op call.
pub struct ShapeCheck<'a> {
    op: &'static str,
    shapes: &'a BTreeMap<String, Vec<usize>>,
    seen: RefCell<BTreeSet<String>>,
}

fn describe(dims: &[&str]) -> String {
    format!("[{}]", dims.join(", "))
}

impl<'a> ShapeCheck<'a> {
    pub fn new(op: &'static str, shapes: &'a BTreeMap<String, Vec<usize>>) -> Self {
        ShapeCheck { op, shapes, seen: RefCell::new(BTreeSet::new()) }
    }

    pub fn op(&self) -> &'static str {
        self.op
    }

    pub fn error(&self, tensor: &str, problem: impl Into<String>) -> Error {
        Error::tensor(self.op, tensor, problem)
    }

    /// Whether `name` was given.
    pub fn has(&self, name: &str) -> bool {
        self.seen.borrow_mut().insert(name.to_string());
        self.shapes.contains_key(name)
    }

    /// A required tensor of the given rank (dims named for messages); no dimension may be zero.
    pub fn required(&self, name: &str, dims: &[&str]) -> Result<Vec<usize>> {
        if !self.has(name) {
            return Err(self.error(name, format!("missing (expected shape {})", describe(dims))));
        }
        self.ranked(name, dims)
    }

    /// An optional tensor of the given rank, or `None` when absent.
    pub fn optional(&self, name: &str, dims: &[&str]) -> Result<Option<Vec<usize>>> {
        if !self.has(name) {
            return Ok(None);
        }
        self.ranked(name, dims).map(Some)
    }

    fn ranked(&self, name: &str, dims: &[&str]) -> Result<Vec<usize>> {
        let shape = &self.shapes[name];
        if shape.len() != dims.len() {
            return Err(
                self.error(name, format!("expected rank {} {}, got shape {:?}", dims.len(), describe(dims), shape))
            );
        }
        if let Some(axis) = shape.iter().position(|&d| d == 0) {
            return Err(self.error(name, format!("dimension `{}` is zero in shape {:?}", dims[axis], shape)));
        }
        Ok(shape.clone())
    }

    /// A required tensor of exactly the given shape; `dims` pairs each size with its name.
    pub fn exact(&self, name: &str, dims: &[(&str, usize)]) -> Result<()> {
        let labels: Vec<&str> = dims.iter().map(|d| d.0).collect();
        let shape = self.required(name, &labels)?;
        self.compare(name, dims, &shape)
    }

    /// An optional tensor of exactly the given shape; true when given.
    pub fn exact_optional(&self, name: &str, dims: &[(&str, usize)]) -> Result<bool> {
        let labels: Vec<&str> = dims.iter().map(|d| d.0).collect();
        match self.optional(name, &labels)? {
            None => Ok(false),
            Some(shape) => self.compare(name, dims, &shape).map(|_| true),
        }
    }

    fn compare(&self, name: &str, dims: &[(&str, usize)], shape: &[usize]) -> Result<()> {
        let expected: Vec<usize> = dims.iter().map(|d| d.1).collect();
        if shape != expected.as_slice() {
            let named: Vec<String> = dims.iter().map(|(label, size)| format!("{label}={size}")).collect();
            return Err(
                self.error(name, format!("expected shape {:?} ([{}]), got {:?}", expected, named.join(", "), shape))
            );
        }
        Ok(())
    }

    /// Refuses tensors that no check asked for.
    pub fn finish(&self) -> Result<()> {
        let seen = self.seen.borrow();
        if let Some(unknown) = self.shapes.keys().find(|k| !seen.contains(*k)) {
            let accepted: Vec<&str> = seen.iter().map(String::as_str).collect();
            return Err(self.error(unknown, format!("not an input of this op (it takes: {})", accepted.join(", "))));
        }
        Ok(())
    }
}

/// Scalar checks over the string scalars of one op call.
pub struct ScalarCheck<'a> {
    op: &'static str,
    scalars: &'a Scalars,
    seen: RefCell<BTreeSet<String>>,
}

impl<'a> ScalarCheck<'a> {
    pub fn new(op: &'static str, scalars: &'a Scalars) -> Self {
        ScalarCheck { op, scalars, seen: RefCell::new(BTreeSet::new()) }
    }

    pub fn error(&self, scalar: &str, problem: impl Into<String>) -> Error {
        Error::scalar(self.op, scalar, problem)
    }

    fn raw(&self, name: &str) -> Option<&'a str> {
        self.seen.borrow_mut().insert(name.to_string());
        self.scalars.get(name).map(str::trim)
    }

    /// An f32 (`inf`, `-inf` accepted), or `default` when absent.
    pub fn f32_or(&self, name: &str, default: f32) -> Result<f32> {
        match self.raw(name) {
            None => Ok(default),
            Some(text) => parse_f32(text).ok_or_else(|| self.error(name, format!("expected a number, got {text:?}"))),
        }
    }

    /// A finite f32, or `default` when absent.
    pub fn finite_f32_or(&self, name: &str, default: f32) -> Result<f32> {
        let value = self.f32_or(name, default)?;
        if !value.is_finite() {
            return Err(self.error(name, format!("must be finite, got {value}")));
        }
        Ok(value)
    }

    /// A required non-negative integer.
    pub fn u32_required(&self, name: &str) -> Result<u32> {
        match self.raw(name) {
            None => Err(self.error(name, "missing (a required integer)")),
            Some(text) => {
                text.parse().map_err(|_| self.error(name, format!("expected a non-negative integer, got {text:?}")))
            }
        }
    }

    /// A non-negative integer, or `default` when absent.
    pub fn u32_or(&self, name: &str, default: u32) -> Result<u32> {
        match self.raw(name) {
            None => Ok(default),
            Some(text) => {
                text.parse().map_err(|_| self.error(name, format!("expected a non-negative integer, got {text:?}")))
            }
        }
    }

    /// A flag written `0`/`1` (or `false`/`true`), or `default` when absent.
    pub fn flag_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.raw(name) {
            None => Ok(default),
            Some("1") | Some("true") => Ok(true),
            Some("0") | Some("false") => Ok(false),
            Some(text) => Err(self.error(name, format!("expected 0 or 1, got {text:?}"))),
        }
    }

    /// Refuses scalars that no check asked for (a misspelt scalar would otherwise be ignored).
    pub fn finish(&self) -> Result<()> {
        let seen = self.seen.borrow();
        for (name, _) in self.scalars.iter() {
            if !seen.contains(name) && !IGNORED_METADATA.contains(&name) {
                let accepted: Vec<&str> = seen.iter().map(String::as_str).collect();
                return Err(self.error(name, format!("not a scalar of this op (it takes: {})", accepted.join(", "))));
            }
        }
        Ok(())
    }
}

/// Parses a decimal float, accepting `inf`, `+inf`, `-inf`, `infinity` and `nan`.
pub fn parse_f32(text: &str) -> Option<f32> {
    match text.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => Some(f32::INFINITY),
        "-inf" | "-infinity" => Some(f32::NEG_INFINITY),
        other => other.parse::<f32>().ok(),
    }
}
