;; Imports sock_connect, which WASI preview 1 does not provide: must fail to link.
(module
  (import "wasi_snapshot_preview1" "sock_connect"
    (func $sock_connect (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (drop (call $sock_connect (i32.const 0) (i32.const 0) (i32.const 0)))))
