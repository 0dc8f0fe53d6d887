//! The deterministic second pass of every cross-workgroup sum: column sums through
//! `shaders/kernels/column_sum.slang`, chained until one row is left. The chunking is a function
//! of the row count alone, so the summation order never depends on the device.

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu};
use crate::kernels;
use crate::ops::Recorded;
use crate::push_constants;

push_constants! {
    /// Push constants of `column_sum.slang`.
    pub struct ColumnSumPush {
        input: u32,
        output: u32,
        rows: u32,
        cols: u32,
        input_offset: u32,
        row_stride: u32,
    }
}
const _: () = assert!(std::mem::size_of::<ColumnSumPush>() == kernels::column_sum::PUSH_CONSTANT_BYTES);

/// Rows one workgroup sums (CHUNK_ROWS in the shader).
const CHUNK_ROWS: usize = 256;
/// Columns one workgroup covers (COLUMNS_PER_GROUP in the shader).
const COLUMNS_PER_GROUP: usize = 32;

/// A strided matrix of partial sums: element (r, j) at `offset + r * row_stride + j`.
#[derive(Clone, Copy, Debug)]
pub struct Partials {
    pub slot: u32,
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
    pub row_stride: usize,
}

/// Appends the dispatches that write `output[j] = sum_r partials(r, j)` (f32, fixed order).
pub fn column_sums(recorded: &mut Recorded, gpu: &dyn Gpu, op: &str, partials: Partials, output: u32) -> Result<()> {
    let mut current = partials;
    loop {
        let chunks = current.rows.div_ceil(CHUNK_ROWS);
        if chunks > 65535 {
            return Err(Error::unsupported(
                op,
                format!("a reduction over {} rows exceeds the grid limit", current.rows),
            ));
        }
        let target = if chunks == 1 {
            output
        } else {
            recorded.scratch(gpu, op, "column partial sums", chunks * current.cols)?
        };
        let push = ColumnSumPush {
            input: current.slot,
            output: target,
            rows: current.rows as u32,
            cols: current.cols as u32,
            input_offset: current.offset as u32,
            row_stride: current.row_stride as u32,
        };
        let groups = [current.cols.div_ceil(COLUMNS_PER_GROUP) as u32, chunks as u32, 1];
        recorded.dispatches.push(Dispatch::new(kernels::column_sum::COLUMN_SUM, groups, &push)?);
        if chunks == 1 {
            return Ok(());
        }
        current = Partials { slot: target, rows: chunks, cols: current.cols, offset: 0, row_stride: current.cols };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn push_layout_matches_reflection() {
        crate::gpu::check_push_layout::<super::ColumnSumPush>(crate::kernels::column_sum::FILE).unwrap();
    }
}
