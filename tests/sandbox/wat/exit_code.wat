;; Exits with 200: wasmtime reports codes >= 126 as a plain error without the code.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start") (call $proc_exit (i32.const 200))))
