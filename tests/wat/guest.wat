;; A test inferlet: `run(input)` acts on the first byte of its input.
;;   o: ok(input)        e: err(input)          t: traps (unreachable)
;;   l: loops forever    c: counts a while, then ok(input)
;;   p: writes input to stdout and "printed" to stderr, then ok(input)
;;   h: calls the host import `block`, then ok(input)
;;   m: grows memory a page at a time until refused, says so on stderr (as a Rust guest
;;      does), then traps
(component $C
  (import "wasi:io/error@0.2.0" (instance $io-error
    (export "error" (type (sub resource)))))
  (alias export $io-error "error" (type $error))
  (import "wasi:io/streams@0.2.0" (instance $streams
    (alias outer $C $error (type $error'))
    (export "error" (type $e (eq $error')))
    (export "output-stream" (type $os (sub resource)))
    (type $stream-error' (variant (case "last-operation-failed" (own $e)) (case "closed")))
    (export "stream-error" (type $stream-error (eq $stream-error')))
    (export "[method]output-stream.blocking-write-and-flush"
      (func (param "self" (borrow $os)) (param "contents" (list u8))
            (result (result (error $stream-error)))))))
  (alias export $streams "output-stream" (type $output-stream))
  (import "wasi:cli/stdout@0.2.0" (instance $stdout
    (alias outer $C $output-stream (type $os'))
    (export "output-stream" (type $os (eq $os')))
    (export "get-stdout" (func (result (own $os))))))
  (import "wasi:cli/stderr@0.2.0" (instance $stderr
    (alias outer $C $output-stream (type $os'))
    (export "output-stream" (type $os (eq $os')))
    (export "get-stderr" (func (result (own $os))))))
  (import "block" (func $block))

  (core module $Memory
    (memory (export "mem") 1)
    (global $top (mut i32) (i32.const 1024))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $p i32)
      (local.set $p
        (i32.and
          (i32.add (global.get $top) (i32.sub (local.get 2) (i32.const 1)))
          (i32.sub (i32.const 0) (local.get 2))))
      (global.set $top (i32.add (local.get $p) (local.get 3)))
      (if (i32.gt_u (global.get $top) (i32.shl (memory.size) (i32.const 16)))
        (then
          (if (i32.eq
                (memory.grow (i32.add (i32.shr_u (global.get $top) (i32.const 16)) (i32.const 1)))
                (i32.const -1))
            (then unreachable))))
      (local.get $p)))
  (core instance $memory (instantiate $Memory))
  (alias core export $memory "mem" (core memory $mem))
  (alias core export $memory "realloc" (core func $realloc))

  (core func $get-stdout (canon lower (func $stdout "get-stdout")))
  (core func $get-stderr (canon lower (func $stderr "get-stderr")))
  (core func $write
    (canon lower (func $streams "[method]output-stream.blocking-write-and-flush") (memory $mem)))
  (core func $block' (canon lower (func $block)))

  (core module $Main
    (import "env" "mem" (memory 1))
    (import "wasi" "get-stdout" (func $get-stdout (result i32)))
    (import "wasi" "get-stderr" (func $get-stderr (result i32)))
    (import "wasi" "write" (func $write (param i32 i32 i32 i32)))
    (import "host" "block" (func $block))
    (data (i32.const 64) "memory allocation of 65536 bytes failed\n")
    (data (i32.const 128) "printed")

    ;; result<string, string> in the return area at 16: case byte, then pointer and length.
    (func $result (param $case i32) (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const 16) (local.get $case))
      (i32.store (i32.const 20) (local.get $ptr))
      (i32.store (i32.const 24) (local.get $len))
      (i32.const 16))

    (func $out-of-memory
      (block $refused
        (loop $grow
          (br_if $refused (i32.eq (memory.grow (i32.const 1)) (i32.const -1)))
          (br $grow)))
      (call $write (call $get-stderr) (i32.const 64) (i32.const 40) (i32.const 32))
      unreachable)

    (func $count
      (local $n i32)
      (local.set $n (i32.const 500000000))
      (loop $next
        (local.set $n (i32.sub (local.get $n) (i32.const 1)))
        (br_if $next (local.get $n))))

    (func (export "run") (param $ptr i32) (param $len i32) (result i32)
      (local $c i32)
      (if (local.get $len) (then (local.set $c (i32.load8_u (local.get $ptr)))))
      (if (i32.eq (local.get $c) (i32.const 0x65)) ;; e
        (then (return (call $result (i32.const 1) (local.get $ptr) (local.get $len)))))
      (if (i32.eq (local.get $c) (i32.const 0x74)) ;; t
        (then unreachable))
      (if (i32.eq (local.get $c) (i32.const 0x6c)) ;; l
        (then (loop $forever (br $forever))))
      (if (i32.eq (local.get $c) (i32.const 0x63)) ;; c
        (then (call $count)))
      (if (i32.eq (local.get $c) (i32.const 0x70)) ;; p
        (then
          (call $write (call $get-stdout) (local.get $ptr) (local.get $len) (i32.const 32))
          (call $write (call $get-stderr) (i32.const 128) (i32.const 7) (i32.const 32))))
      (if (i32.eq (local.get $c) (i32.const 0x68)) ;; h
        (then (call $block)))
      (if (i32.eq (local.get $c) (i32.const 0x6d)) ;; m
        (then (call $out-of-memory)))
      (call $result (i32.const 0) (local.get $ptr) (local.get $len))))
  (core instance $main (instantiate $Main
    (with "env" (instance (export "mem" (memory $mem))))
    (with "wasi" (instance
      (export "get-stdout" (func $get-stdout))
      (export "get-stderr" (func $get-stderr))
      (export "write" (func $write))))
    (with "host" (instance (export "block" (func $block'))))))

  (func (export "run") (param "input" string) (result (result string (error string)))
    (canon lift (core func $main "run") (memory $mem) (realloc $realloc)))
)
