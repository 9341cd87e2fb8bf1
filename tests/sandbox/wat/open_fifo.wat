;; Open "fifo" in the first preopen (fd 3) for reading. A FIFO without a writer blocks
;; the open inside wasmtime's host code, where no epoch tick can reach it; exit 5 if the
;; open ever returns.
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "fifo")
  (func (export "_start")
    (drop (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 4)
      (i32.const 0) (i64.const 2) (i64.const 2) (i32.const 0) (i32.const 64)))
    (call $exit (i32.const 5))))
