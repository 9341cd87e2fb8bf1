;; A hand-written WASI preview 1 executor: ignores its arguments and writes one JSON
;; document to stdout with a single fd_write. wasmtime compiles the text form directly,
;; so no .wasm binary is committed.
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  ;; The document at 16 (32 bytes); its iovec {buf=16, len=32} at 0; nwritten at 8.
  (data (i32.const 16) "{\"greeting\": \"hello from wasm\"}\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 32))
    ;; A failed write is the executor's failure: exit 1 rather than pretend.
    (if (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))
      (then (call $proc_exit (i32.const 1))))))
