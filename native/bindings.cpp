// The pybind11 edge: thin, releases the GIL around anything that can block,
// and the only place where native errors become Python exceptions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "cpu/adam.hpp"
#include "cpu/crc32c.hpp"
#include "cpu/parallel.hpp"
#include "cpu/simd.hpp"
#include "io/engine.hpp"
#include "io/fault.hpp"
#include "io/file.hpp"
#include "io/handle.hpp"

namespace py = pybind11;
using namespace infinity::io;

namespace {

// OSError(errno, message, path) lets Python pick the subclass
// (FileNotFoundError, PermissionError, ...); `offset` rides along.
void raise_os_error(const IoError& e) {
  const ErrorInfo& info = e.info();
  // Python's OSError adds "[Errno N]" and the path itself.
  std::string msg = (info.what.empty() ? std::string(std::strerror(info.err)) : info.what + " (" + std::strerror(info.err) + ")");
  if (info.offset >= 0) msg += ", at offset " + std::to_string(info.offset);
  py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(
      info.err, msg, info.path.empty() ? py::object(py::none()) : py::object(py::str(info.path)));
  exc.attr("offset") = info.offset;
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

// Page-aligned memory exposed through the buffer protocol; torch.frombuffer
// keeps this object alive for as long as any tensor uses the memory.
//
// [Note: pool buffers on huge pages]
// A buffer of 2 MiB or more is aligned to 2 MiB and advised MADV_HUGEPAGE
// (where transparent huge pages are "madvise", the common default, nothing
// else would give it huge pages). An O_DIRECT request pins its user pages in
// the kernel: a 1 MiB request into 4 KiB pages pins 256 of them, into a huge
// page one. Reading a 1 GiB file at 1 MiB x QD32 with libaio cost the
// submitting process 37-50 ms of CPU on 4 KiB pages and 8-11 ms on huge
// pages, on the 2-core reference VM, where that CPU is the step's. The
// advice can be refused (a kernel without THP: EINVAL); the buffer then
// works as before on small pages, and huge_pages says which it got. Swap
// pools, staging and bench buffers all come from here (aligned_empty).
class AlignedBuffer {
 public:
  static constexpr size_t kHuge = size_t(2) << 20;

  AlignedBuffer(size_t nbytes, size_t alignment) : nbytes_(nbytes) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment < sizeof(void*))
      throw ArgumentError("alignment must be a power of two >= " + std::to_string(sizeof(void*)) + ", got " +
                          std::to_string(alignment));
    if (nbytes >= kHuge && alignment < kHuge) alignment = kHuge;
    mem_ = aligned_alloc_bytes(nbytes, alignment);
    if (!mem_) throw std::bad_alloc();
    // Advice only (see the note): a refusal leaves small pages, which work.
    if (nbytes >= kHuge) huge_pages_ = ::madvise(mem_, nbytes / kHuge * kHuge, MADV_HUGEPAGE) == 0;
    // Fresh pages are touched here so that the first I/O does not pay for
    // page faults inside the timed region of a benchmark.
    std::memset(mem_, 0, nbytes);
  }
  ~AlignedBuffer() { std::free(mem_); }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(mem_); }
  size_t nbytes() const { return nbytes_; }
  void* data() const { return mem_; }
  bool huge_pages() const { return huge_pages_; }

 private:
  void* mem_ = nullptr;
  size_t nbytes_;
  bool huge_pages_ = false;
};

py::tuple buffer_address(py::handle obj, bool writable) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_FULL_RO) != 0) {
    PyErr_Clear();
    throw ArgumentError(std::string("expected a contiguous CPU tensor, a numpy array or a buffer, got ") +
                        Py_TYPE(obj.ptr())->tp_name);
  }
  bool readonly = view.readonly;
  bool contiguous = PyBuffer_IsContiguous(&view, 'C');
  uintptr_t ptr = reinterpret_cast<uintptr_t>(view.buf);
  size_t len = static_cast<size_t>(view.len);
  PyBuffer_Release(&view);
  if (writable && readonly)
    throw ArgumentError("buffer is read-only: pread needs a writable buffer to read into");
  if (!contiguous) throw ArgumentError("buffer is not contiguous: pass a contiguous copy");
  return py::make_tuple(ptr, len);
}

infinity::cpu::Dtype dtype_from(const std::string& name, const char* arg) {
  using infinity::cpu::Dtype;
  if (name == "float32") return Dtype::kF32;
  if (name == "bfloat16") return Dtype::kBF16;
  if (name == "float16") return Dtype::kF16;
  throw ArgumentError(std::string(arg) + ": unsupported dtype " + name);
}

infinity::cpu::SimdLevel simd_from(const std::string& name) {
  using infinity::cpu::SimdLevel;
  if (name == "auto") return infinity::cpu::active_simd();
  SimdLevel want = name == "scalar" ? SimdLevel::kScalar : name == "avx2" ? SimdLevel::kAvx2
                 : name == "avx512" ? SimdLevel::kAvx512 : name == "avx512_bf16" ? SimdLevel::kAvx512Bf16
                 : static_cast<SimdLevel>(-1);
  if (static_cast<int>(want) < 0)
    throw ArgumentError("simd must be auto, scalar, avx2, avx512 or avx512_bf16, got " + name);
  if (static_cast<int>(want) > static_cast<int>(infinity::cpu::detected_simd()))
    throw ArgumentError("simd=" + name + " is not supported by this CPU (it has " +
                        infinity::cpu::simd_name(infinity::cpu::detected_simd()) + ")");
  return want;
}

Backend backend_from(const std::string& name) {
  Backend b;
  if (!parse_backend(name, &b))
    throw ArgumentError("unknown native backend '" + name + "': expected libaio, io_uring or threads");
  return b;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "infinity native core: async file I/O and CPU kernels (no torch headers)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      raise_os_error(e);
    } catch (const ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  arm_fault_from_env();

  py::class_<Request, std::shared_ptr<Request>>(m, "Future")
      .def("wait", &Request::wait, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "Block until done or timeout seconds (negative: forever); True when done.")
      .def("done", &Request::done)
      .def("result", &Request::result, "Bytes moved; raises OSError if the request failed.")
      .def("crc32c", &Request::crc32c,
           "CRC-32C of the bytes a read submitted with checksum=True brought in (taken by the I/O worker).")
      .def_property_readonly("path", &Request::path)
      .def_property_readonly("offset", &Request::offset)
      .def_property_readonly("nbytes", &Request::nbytes)
      .def_property_readonly("is_write", &Request::is_write);

  py::class_<Handle>(m, "Handle")
      .def(py::init([](const std::string& backend, size_t block_size, int queue_depth, int threads, bool direct,
                       bool single_submit, bool overlap_events, size_t fd_cache) {
             HandleOptions o;
             o.fd_cache = fd_cache;
             o.single_submit = single_submit;
             o.overlap_events = overlap_events;
             o.backend = backend_from(backend);
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.threads = threads;
             o.direct = direct;
             return std::make_unique<Handle>(o);
           }),
           py::arg("backend"), py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"), py::arg("direct"),
           py::arg("single_submit") = false, py::arg("overlap_events") = true, py::arg("fd_cache") = 1024)
      .def(
          "submit",
          [](Handle& h, bool write, uintptr_t ptr, size_t nbytes, const std::string& path, int64_t offset,
             bool checksum) { return h.submit(write, reinterpret_cast<void*>(ptr), nbytes, path, offset, checksum); },
          py::arg("write"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"), py::arg("offset"),
          py::arg("checksum") = false,
          py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &Handle::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("forget", &Handle::forget, py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def("close", &Handle::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Handle::closed)
      .def_property_readonly("inflight", &Handle::inflight)
      .def_property_readonly("bytes_read", &Handle::bytes_read)
      .def_property_readonly("bytes_written", &Handle::bytes_written)
      .def_property_readonly("submit_calls", &Handle::submit_calls)
      .def_property_readonly("files_opened", &Handle::files_opened)
      .def_property_readonly("fds_cached", &Handle::fds_cached);

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, size_t>(), py::arg("nbytes"), py::arg("alignment") = 4096)
      .def_property_readonly("address", &AlignedBuffer::address)
      .def_property_readonly("nbytes", &AlignedBuffer::nbytes)
      .def_property_readonly("huge_pages", &AlignedBuffer::huge_pages,
                             "True when the kernel took MADV_HUGEPAGE for it (2 MiB or more; see the note)")
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });

  m.def("buffer_address", &buffer_address, py::arg("obj"), py::arg("writable"),
        "(address, nbytes) of a C-contiguous buffer; ValueError if read-only (when writable) or strided.");
  m.def("compiled_backends", [] {
    std::vector<std::string> out;
    for (Backend b : {Backend::kIoUring, Backend::kLibaio, Backend::kThreads})
      if (backend_compiled(b)) out.push_back(backend_name(b));
    return out;
  });
  m.def(
      "probe_backend",
      [](const std::string& name) {
        Backend b = backend_from(name);
        if (!backend_compiled(b)) return std::string("not compiled in (headers missing at build time)");
        int err = 0;
        auto e = make_engine(b, 4, &err);
        return e ? std::string() : std::string(std::strerror(err));
      },
      "Empty string when the backend starts here, else why not.");
  m.def("page_size", &page_size);
  m.def(
      "direct_alignment",
      [](const std::string& path) {
        if (path.find('\0') != std::string::npos) throw ArgumentError("path contains a NUL byte");
        int64_t a = direct_alignment_of_path(path);
        if (a < 0) throw IoError(ErrorInfo{static_cast<int>(-a), path, -1, "statx failed"});
        return a;
      },
      py::arg("path"), "O_DIRECT alignment for files under path; 0 if the filesystem has no O_DIRECT.");
  m.def(
      "set_fault",
      [](int64_t nth, const std::string& mode, int err) {
        FaultMode fm = mode == "errno" ? FaultMode::kErrno : mode == "short" ? FaultMode::kShort
                     : mode == "zero"  ? FaultMode::kZero : FaultMode::kNone;
        if (fm == FaultMode::kNone) throw ArgumentError("fault mode must be errno, short or zero, got " + mode);
        if (nth < 1) throw ArgumentError("nth must be >= 1, got " + std::to_string(nth));
        arm_fault(nth, fm, err);
      },
      py::arg("nth"), py::arg("mode"), py::arg("errno") = 5,
      "Test only: make the nth chunk completion from now fail (errno), come back half (short) or empty (zero).");
  m.def("clear_fault", &disarm_fault);
  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         size_t n, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
         bool bias_correction, double grad_scale, uintptr_t out_lowp, const std::string& lowp_dtype,
         bool check_finite, const std::string& simd, const std::string& moment_dtype,
         const std::string& moment_rounding, uint32_t moment_seed, uintptr_t exp_avg_scale,
         uintptr_t exp_avg_sq_scale) {
        infinity::cpu::AdamArgs a;
        a.param = reinterpret_cast<float*>(param);
        a.grad = reinterpret_cast<const void*>(grad);
        a.grad_dtype = dtype_from(grad_dtype, "grad");
        a.exp_avg = reinterpret_cast<void*>(exp_avg);
        a.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
        if (moment_dtype == "int8") {  // 8-bit blocks: codes in exp_avg / exp_avg_sq, plus their scales
          if (!exp_avg_scale || !exp_avg_sq_scale)
            throw ArgumentError("int8 moments need exp_avg_scale and exp_avg_sq_scale");
          a.moment_dtype = infinity::cpu::Dtype::kI8;
          a.exp_avg_scale = reinterpret_cast<float*>(exp_avg_scale);
          a.exp_avg_sq_scale = reinterpret_cast<float*>(exp_avg_sq_scale);
        } else {
          a.moment_dtype = dtype_from(moment_dtype, "exp_avg");
        }
        if (a.moment_dtype == infinity::cpu::Dtype::kF16)
          throw ArgumentError("exp_avg must be float32, bfloat16 or int8, got float16");
        if (moment_rounding != "nearest" && moment_rounding != "stochastic")
          throw ArgumentError("moment_rounding must be nearest or stochastic, got " + moment_rounding);
        a.moment_rounding = moment_rounding == "stochastic" ? infinity::cpu::Rounding::kStochastic
                                                            : infinity::cpu::Rounding::kNearest;
        a.moment_seed = moment_seed;
        a.out_lowp = reinterpret_cast<void*>(out_lowp);
        a.lowp_dtype = out_lowp ? dtype_from(lowp_dtype, "out_lowp") : infinity::cpu::Dtype::kBF16;
        a.n = n;
        a.step = step;
        a.lr = lr;
        a.beta1 = beta1;
        a.beta2 = beta2;
        a.eps = eps;
        a.weight_decay = weight_decay;
        a.adamw = adamw;
        a.bias_correction = bias_correction;
        a.grad_scale = grad_scale;
        a.check_finite = check_finite;
        infinity::cpu::SimdLevel level = simd_from(simd);
        py::gil_scoped_release nogil;
        return infinity::cpu::adam_step(a, level);
      },
      "Raw-pointer CPU Adam step (validated by infinity.optim.cpu_adam_step); True if skipped for inf/nan.");
  m.def(
      "any_nonfinite",
      [](uintptr_t grad, const std::string& dtype, size_t n, double grad_scale) {
        infinity::cpu::Dtype dt = dtype_from(dtype, "grad");
        infinity::cpu::SimdLevel level = infinity::cpu::active_simd();
        py::gil_scoped_release nogil;
        return infinity::cpu::any_nonfinite(reinterpret_cast<const void*>(grad), dt, n,
                                            static_cast<float>(1.0 / grad_scale), level);
      },
      "True if any grad / grad_scale is inf or nan (read-only, multithreaded).");
  m.def(
      "stream_adam_traffic",
      [](uintptr_t p, uintptr_t g, uintptr_t mm, uintptr_t v, uintptr_t lowp, size_t n, int repeats) {
        py::gil_scoped_release nogil;
        return infinity::cpu::stream_adam_traffic(reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g),
                                                  reinterpret_cast<float*>(mm), reinterpret_cast<float*>(v),
                                                  reinterpret_cast<uint16_t*>(lowp), n, repeats);
      },
      "Seconds for `repeats` sweeps with Adam's memory traffic (the roofline reference).");
  m.def(
      "crc32c",
      [](uintptr_t ptr, size_t n, uint32_t seed, bool portable) {
        py::gil_scoped_release nogil;
        const void* p = reinterpret_cast<const void*>(ptr);
        return portable ? infinity::cpu::crc32c_portable(p, n, seed) : infinity::cpu::crc32c(p, n, seed);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::arg("portable") = false,
      "CRC-32C of nbytes at ptr (hardware when available; portable=True forces the table).");
  m.def("crc32c_combine", &infinity::cpu::crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
        "crc32c(A || B) from crc32c(A), crc32c(B) and len(B) (both CRCs from seed 0).");
  m.def("set_num_threads", &infinity::cpu::set_num_threads, "Threads for CPU kernels; < 1 means all cores.");
  m.def("get_num_threads", &infinity::cpu::num_threads);
  m.def("simd_level", [] { return std::string(infinity::cpu::simd_name(infinity::cpu::active_simd())); });
  m.def("cpu_simd_level", [] { return std::string(infinity::cpu::simd_name(infinity::cpu::detected_simd())); });
  m.def("cpu_has_avx512_bf16", &infinity::cpu::cpu_has_avx512_bf16);
}
