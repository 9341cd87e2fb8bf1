;; Reference assertion (a): write "ok\n" to stdout with fd_write, then return (exit 0).
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  ;; iovec at 0: {buf=16, len=3}; the text at 16; nwritten at 32.
  (data (i32.const 0) "\10\00\00\00\03\00\00\00")
  (data (i32.const 16) "ok\n")
  (func (export "_start")
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 32)))))
