//! Host tensors (row-major, contiguous) and the string scalars that travel with them.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// A dense row-major tensor on the host. `f32` for the kernels' contract, `f64` inside the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T = f32> {
    shape: Vec<usize>,
    data: Vec<T>,
}

/// Named tensors, as an op takes and returns them.
pub type TensorMap<T = f32> = BTreeMap<String, Tensor<T>>;

impl<T: Copy + Default> Tensor<T> {
    /// A tensor of the given shape holding `data`; the lengths must agree.
    pub fn new(shape: Vec<usize>, data: Vec<T>) -> Result<Self> {
        let elements = element_count(&shape);
        if elements != data.len() {
            return Err(Error::tensor(
                "tensor",
                "data",
                format!("shape {shape:?} holds {elements} elements, data has {}", data.len()),
            ));
        }
        Ok(Tensor { shape, data })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let elements = element_count(&shape);
        Tensor { shape, data: vec![T::default(); elements] }
    }

    /// A tensor whose element `i` (row-major) is `f(i)`.
    pub fn from_fn(shape: Vec<usize>, f: impl FnMut(usize) -> T) -> Self {
        let elements = element_count(&shape);
        Tensor { shape, data: (0..elements).map(f).collect() }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn data(&self) -> &[T] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }

    pub fn into_data(self) -> Vec<T> {
        self.data
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl Tensor<f32> {
    /// The same values widened to f64, for the reference.
    pub fn to_f64(&self) -> Tensor<f64> {
        Tensor { shape: self.shape.clone(), data: self.data.iter().map(|&v| f64::from(v)).collect() }
    }
}

impl Tensor<f64> {
    /// The same values rounded to f32.
    pub fn to_f32(&self) -> Tensor<f32> {
        Tensor { shape: self.shape.clone(), data: self.data.iter().map(|&v| v as f32).collect() }
    }
}

/// Product of the dimensions (1 for a scalar shape).
pub fn element_count(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Scalar arguments as strings, exactly as they travel in a safetensors header's `__metadata__`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scalars(BTreeMap<String, String>);

impl Scalars {
    pub fn new() -> Self {
        Scalars(BTreeMap::new())
    }

    /// Builder form: `Scalars::new().with("eps", 1e-5)`.
    pub fn with(mut self, name: &str, value: impl ToString) -> Self {
        self.0.insert(name.to_string(), value.to_string());
        self
    }

    pub fn set(&mut self, name: &str, value: impl ToString) {
        self.0.insert(name.to_string(), value.to_string());
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    pub fn remove(&mut self, name: &str) -> Option<String> {
        self.0.remove(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl From<BTreeMap<String, String>> for Scalars {
    fn from(map: BTreeMap<String, String>) -> Self {
        Scalars(map)
    }
}

impl FromIterator<(String, String)> for Scalars {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        Scalars(iter.into_iter().collect())
    }
}

impl<T: Copy + Default> Tensor<T> {
    /// A tensor whose shape and data the caller built to agree (the references' outputs): a
    /// disagreement is a bug in this crate, not bad input, so it panics with both sizes.
    pub(crate) fn from_parts(shape: Vec<usize>, data: Vec<T>) -> Self {
        assert_eq!(element_count(&shape), data.len(), "internal: tensor shape {shape:?} does not match its data");
        Tensor { shape, data }
    }
}
